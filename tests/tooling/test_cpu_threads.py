"""The C++ CPU kernels on torch's OpenMP threads (setup.py builds the extension with -fopenmp
where that joins torch's runtime): one OpenMP runtime in the process, and every parallelised op
bit-identical at 1, 2 and 3 threads (each output element written by one thread, in the order of
the serial loop). The shapes put every call above its kernel's grain, so 2 and 3 threads really
split the work (the serial results themselves are checked against the float64 reference by each
op's own test file)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import torch

import ragattn
from tests.helpers import randn_nonzero
from tests.ops.test_kv_cache import inv_freq_for, rand_delta
from tests.ops.paged_attention.test_paged_attention import make_case as paged_case
from tests.ops.test_verify_draft import make_case as verify_case

THREADS = (1, 2, 3)  # 3 threads on a 2-core machine too: uneven splits

# a mapped file whose name is an OpenMP runtime: GNU libgomp, LLVM libomp, Intel libiomp5
_OPENMP_LIB = re.compile(r"/lib(gomp|omp|iomp5)[-.][^/]*\.so[.0-9]*$|/lib(gomp|omp|iomp5)\.so[.0-9]*$")


def openmp_runtimes(maps_text: str) -> dict:
    """{(device, inode): path} of the OpenMP runtime files in a /proc/<pid>/maps text."""
    found = {}
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and _OPENMP_LIB.search(parts[5].strip()):
            found[(parts[3], parts[4])] = parts[5].strip()
    return found


def test_openmp_runtime_detector():
    """The check below can fail: two files named libgomp (torch's and the system's) count twice,
    the same file mapped several times once."""
    maps = "\n".join([
        "7f00-7f01 r--p 00000000 00:2a 111 /venv/torch/lib/libgomp.so.1",
        "7f01-7f02 r-xp 00001000 00:2a 111 /venv/torch/lib/libgomp.so.1",
        "7f03-7f04 r--p 00000000 08:01 222 /usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0",
        "7f05-7f06 r--p 00000000 08:01 333 /usr/lib/x86_64-linux-gnu/libgompish.txt",
    ])
    assert sorted(openmp_runtimes(maps).values()) == ["/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0",
                                                      "/venv/torch/lib/libgomp.so.1"]
    assert len(openmp_runtimes("\n".join(maps.splitlines()[:2]))) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps and ELF headers")
def test_one_openmp_runtime():
    """After `import torch, ragattn` the process maps at most one OpenMP runtime, and where the
    extension links one it asks for torch's by SONAME (so the loader reuses torch's copy)."""
    import ragattn._C as ext

    with open("/proc/self/maps") as f:
        runtimes = openmp_runtimes(f.read())
    assert len(runtimes) <= 1, f"more than one OpenMP runtime loaded: {sorted(runtimes.values())}"
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf not found (binutils)")

    def needed(path):
        out = subprocess.run([readelf, "-d", path], capture_output=True, text=True, check=True).stdout
        return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)

    def soname(path):
        out = subprocess.run([readelf, "-d", path], capture_output=True, text=True, check=True).stdout
        return re.findall(r"\(SONAME\)\s+Library soname: \[([^\]]+)\]", out)

    ext_omp = [n for n in needed(ext.__file__) if re.match(r"lib(gomp|omp|iomp5)\b", n)]
    if ext_omp:
        assert runtimes, f"ragattn._C needs {ext_omp} but torch loaded no OpenMP runtime"
        (torch_runtime,) = runtimes.values()
        assert ext_omp == soname(torch_runtime), (ext_omp, torch_runtime)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def _at_threads(fn):
    """fn() at each of THREADS threads; fn returns a tuple of tensors."""
    before = torch.get_num_threads()
    try:
        outs = []
        for n in THREADS:
            torch.set_num_threads(n)
            outs.append(fn())
        return outs
    finally:
        torch.set_num_threads(before)


def assert_thread_count_invariant(fn, what):
    outs = _at_threads(fn)
    for n, got in zip(THREADS[1:], outs[1:]):
        for i, (a, b) in enumerate(zip(outs[0], got)):
            assert torch.equal(_bits(a), _bits(b)), f"{what}: output {i} at {n} threads differs from 1 thread"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rerotate_keys(seed, dtype, interleaved):
    # 5 layers of a paged cache [pages, page_size, H, D] = [23, 13, 3, 64]: 299 rows, 271 rotated
    layers = [randn_nonzero(23, 13, 3, 64, dtype=dtype) for _ in range(5)]
    rows = torch.randperm(23 * 13)[:271]
    delta = rand_delta(271, "cpu")
    delta[::7] = 0  # identity rows

    def run():
        out = [t.clone() for t in layers]
        with torch.inference_mode():
            ragattn.rerotate_keys_(out, rows, delta, inv_freq_for(48), 48, interleaved)
        return tuple(out)

    assert_thread_count_invariant(run, "rerotate_keys_")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["rotate", "plain", "aliased", "k_only"])
def test_copy_kv(seed, dtype, mode):
    """Gather with re-rotation (the chunk store's assembly), a plain scatter, a copy whose source
    and destination share memory (staged through a buffer), and K without V."""
    L, n = 4, 257
    src_k = [randn_nonzero(300, 3, 64, dtype=dtype) for _ in range(L)]
    src_v = [randn_nonzero(300, 3, 64, dtype=dtype) for _ in range(L)]
    dst_k = [randn_nonzero(41, 7, 3, 64, dtype=dtype) for _ in range(L)]  # [pages, page_size, H, D]
    dst_v = [randn_nonzero(41, 7, 3, 64, dtype=dtype) for _ in range(L)]
    src_rows = torch.randint(0, 300, (n,))
    dst_rows = torch.randperm(41 * 7)[:n].int()
    alias_src = torch.randperm(41 * 7)[:n]  # overlaps dst_rows: the op gathers, then scatters
    rotate = mode in ("rotate", "k_only")
    extra = (rand_delta(n, "cpu", 4096), inv_freq_for(64), 64, False) if rotate else ()

    def run():
        dk, dv = [t.clone() for t in dst_k], [t.clone() for t in dst_v]
        with torch.inference_mode():
            if mode == "aliased":  # rows of the destination pages to rows of the same pages
                ragattn.copy_kv_(dk, dv, dk, dv, alias_src, dst_rows)
            elif mode == "k_only":
                ragattn.copy_kv_(dk, [], src_k, [], src_rows, dst_rows, *extra)
            else:
                ragattn.copy_kv_(dk, dv, src_k, src_v, src_rows, dst_rows, *extra)
        return tuple(dk + dv)

    assert_thread_count_invariant(run, f"copy_kv_ {mode}")


@pytest.mark.parametrize("case", ["decode", "prefill", "long"])
def test_paged_attention(seed, case):
    """Decode (one row per sequence, SmolLM2's head shape), scattered prefill rows of three
    sequences (one empty, one of length 1), and a long row over many kChunk chunks."""
    if case == "decode":
        shape = dict(num_heads=9, num_kv_heads=3, head_dim=64, page_size=16)
        rows, lens = [[699], [432]], [700, 433]
    elif case == "prefill":
        shape = dict(num_heads=6, num_kv_heads=2, head_dim=80, page_size=13)
        rows, lens = [list(range(3, 301, 11)), [], [0]], [301, 0, 1]
    else:
        shape = dict(num_heads=4, num_kv_heads=1, head_dim=64, page_size=16)
        rows, lens = [[1030, 1401, 1402]], [1403]
    args = paged_case(rows, lens, dtype=torch.bfloat16 if case == "prefill" else torch.float32, device="cpu", **shape)

    def run():
        with torch.inference_mode():
            return ragattn.paged_attention(*args)

    assert_thread_count_invariant(run, f"paged_attention {case}")


def test_merge_attention_states(seed):
    n, h, d = 301, 5, 64  # 1505 (row, head) items, 512 per task
    out_a, out_b = randn_nonzero(n, h, d), randn_nonzero(n, h, d)
    lse_a, lse_b = 3 * torch.randn(n, h), 3 * torch.randn(n, h)
    lse_a[::5] = float("-inf")
    lse_b[1::7] = float("-inf")

    def run():
        with torch.inference_mode():
            return ragattn.merge_attention_states(out_a, lse_a, out_b, lse_b)

    assert_thread_count_invariant(run, "merge_attention_states")


@pytest.mark.parametrize("eta", [0.0, 10.0])
def test_verify_draft(seed, eta):
    x, q, z, u = verify_case(7, 3, 3001, gen=torch.Generator().manual_seed(seed))

    def run():
        with torch.inference_mode():
            return ragattn.verify_draft(x, q, z, u, eta=eta)

    assert_thread_count_invariant(run, f"verify_draft eta={eta}")
