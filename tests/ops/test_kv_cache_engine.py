"""rerotate_keys_ / copy_kv_ on engine layouts, aliased buffers, inference mode and engine conventions
(int64 deltas, head-major pages)."""
from __future__ import annotations
import pytest
import torch
import ragattn
from ragattn.reference import kv_cache as ref
from tests.helpers import assert_precision, max_abs_err, randn_nonzero, use_kernel_backend

from tests.ops.test_kv_cache import (check_rotated, inv_freq_for, make_layers, rand_delta, rand_rows)


# ---- engine layouts, aliasing, inference mode ----

BACKENDS = ["default", "reference"]



def _flashinfer_caches(L, pages, page_size, H, D, dtype, device):
    """FlashInfer's per-layer paged cache [pages, 2, page_size, H, D]: K = [:, 0], V = [:, 1]."""
    return [randn_nonzero(pages, 2, page_size, H, D, dtype=dtype, device=device) for _ in range(L)]


def _vllm_caches(L, blocks, block_size, H, D, dtype, device):
    """vLLM's FlashAttention per-layer cache [2, blocks, block_size, H, D]: K = [0], V = [1]."""
    return [randn_nonzero(2, blocks, block_size, H, D, dtype=dtype, device=device) for _ in range(L)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("engine", ["flashinfer", "vllm"])
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("row_dtype", [torch.int32, torch.int64])
def test_copy_kv_into_engine_layouts(device, seed, monkeypatch, backend, engine, rotate, row_dtype):
    """Chunk K/V (contiguous store) into an engine's own paged cache, as it is, through its K/V views;
    then back out (strided source). int32 rows like the engines'. Untouched rows stay bit-identical."""
    use_kernel_backend(monkeypatch, device, backend)
    L, H, D, page, pages = 3, 2, 64, 16, 5
    make = _flashinfer_caches if engine == "flashinfer" else _vllm_caches
    caches = make(L, pages, page, H, D, torch.bfloat16, device)
    view = (lambda c, i: c[:, i]) if engine == "flashinfer" else (lambda c, i: c[i])
    before = [c.clone() for c in caches]
    n = 21
    store_k = make_layers(L, (n, H, D), torch.bfloat16, device)
    store_v = make_layers(L, (n, H, D), torch.bfloat16, device)
    src_rows = torch.randperm(n)[:n].to(device=device, dtype=row_dtype)
    dst_rows = rand_rows(pages * page, n, device).to(row_dtype)
    delta = rand_delta(n, device, max_abs=4096) if rotate else None
    f = inv_freq_for(64).to(device)
    dst_k, dst_v = [view(c, 0) for c in caches], [view(c, 1) for c in caches]
    ragattn.copy_kv_(dst_k, dst_v, store_k, store_v, src_rows, dst_rows, delta, f if rotate else None, 64 if rotate else 0)
    for c, b, sk, sv in zip(caches, before, store_k, store_v):
        k_got = ref.gather_rows(view(c, 0), dst_rows)
        v_got = ref.gather_rows(view(c, 1), dst_rows)
        assert torch.equal(v_got, sv[src_rows.long()])
        if rotate:
            r64 = ref.rope_rotate(sk[src_rows.long()].double(), delta, f, 64)
            low = ref.rope_rotate(sk[src_rows.long()], delta, f, 64, compute_dtype=None)
            assert_precision(k_got, r64, low, what="copied keys")
        else:
            assert torch.equal(k_got, sk[src_rows.long()])
        written = torch.zeros(pages * page, dtype=torch.bool, device=device)
        written[dst_rows.long()] = True
        for i in (0, 1):  # every other row of the engine cache is bit-identical
            assert torch.equal(ref.gather_rows(view(c, i), torch.arange(pages * page, device=device))[~written],
                               ref.gather_rows(view(b, i), torch.arange(pages * page, device=device))[~written])
    # ... and back out of the engine cache (strided sources) into a contiguous buffer
    out_k = [torch.full((n, H, D), float("nan"), dtype=torch.bfloat16, device=device) for _ in range(L)]
    out_v = [torch.full((n, H, D), float("nan"), dtype=torch.bfloat16, device=device) for _ in range(L)]
    ragattn.copy_kv_(out_k, out_v, dst_k, dst_v, dst_rows, torch.arange(n, device=device, dtype=row_dtype))
    for ok, ov, dk, dv in zip(out_k, out_v, dst_k, dst_v):
        assert torch.equal(ok, ref.gather_rows(dk, dst_rows)) and torch.equal(ov, ref.gather_rows(dv, dst_rows))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row_dtype", [torch.int32, torch.int64])
def test_rerotate_engine_layout_int32_rows(device, seed, monkeypatch, backend, row_dtype):
    use_kernel_backend(monkeypatch, device, backend)
    caches = _flashinfer_caches(2, 4, 16, 2, 64, torch.float32, device)
    before = [c.clone() for c in caches]
    rows = rand_rows(64, 29, device).to(row_dtype)
    delta = rand_delta(29, device)
    f = inv_freq_for(64).to(device)
    ragattn.rerotate_keys_([c[:, 0] for c in caches], rows, delta, f, 64, True)
    for c, b in zip(caches, before):
        assert torch.equal(c[:, 1], b[:, 1])  # V untouched
        k_got, k0 = ref.gather_rows(c[:, 0], rows), ref.gather_rows(b[:, 0], rows)
        r64 = ref.rope_rotate(k0.double(), delta, f, 64, True)
        assert max_abs_err(k_got, r64) <= 1e-4 * float(r64.abs().max())
        keep = torch.ones(64, dtype=torch.bool, device=device)
        keep[rows.long()] = False
        all_rows = torch.arange(64, device=device)
        assert torch.equal(ref.gather_rows(c[:, 0], all_rows)[keep], ref.gather_rows(b[:, 0], all_rows)[keep])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", ["wrapper", "torch.ops"])
def test_unaddressable_layouts_refused(device, monkeypatch, backend, entry):
    """Head-major pages ([pages, H, page_size, D] transposed), rows overlapping in memory and three
    row levels are refused by name, on every backend, and nothing is written."""
    use_kernel_backend(monkeypatch, device, backend)
    fn = ragattn.copy_kv_ if entry == "wrapper" else torch.ops.ragattn.copy_kv_
    src = make_layers(1, (6, 2, 32), torch.float32, device)
    hnd = randn_nonzero(3, 2, 4, 32, device=device).transpose(1, 2)  # [pages, page_size, H, D], H stride != D
    expanded = randn_nonzero(1, 2, 32, device=device).expand(12, 2, 32)  # every row the same memory
    three = randn_nonzero(4, 3, 4, 3, 2, 32, device=device)[:, :2, :, :2]  # [4, 2, 4, 2, H, D]: three row levels
    for bad, what in ((hnd, "contiguous"), (expanded, "overlap"), (three, "at most two row strides")):
        b0 = bad.clone()
        with pytest.raises(ValueError, match=f"ragattn.copy_kv_: dst_k\\[0\\].*{what}"):
            fn([bad], [], src, [], torch.tensor([0, 1], device=device), torch.tensor([2, 3], device=device))
        assert torch.equal(bad, b0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_kv_aliased_views_gather_then_scatter(device, seed, monkeypatch, backend):
    """Source and destination are different views of one storage with overlapping rows: every
    backend reads all sources before writing (the C++ twin returned wrong rows)."""
    use_kernel_backend(monkeypatch, device, backend)
    cache = randn_nonzero(12, 2, 32, device=device)
    keys = randn_nonzero(12, 2, 32, device=device)
    want_c, want_k = cache.clone(), keys.clone()
    src_rows = torch.arange(6, device=device, dtype=torch.int32)
    dst_rows = torch.arange(6, device=device)
    delta = rand_delta(6, device, max_abs=100)
    f = inv_freq_for(32).to(device)
    # expected: gather from a snapshot, then scatter (dst view starts 2 rows after the src view)
    want_k[2:8] = ref.rope_rotate(keys[0:6], delta, f, 32, compute_dtype=torch.float32)
    want_c[2:8] = cache[0:6]
    ragattn.copy_kv_([keys[2:10]], [cache[2:10]], [keys[0:8]], [cache[0:8]], src_rows, dst_rows, delta, f, 32)
    assert torch.equal(cache, want_c)
    assert max_abs_err(keys, want_k) <= 1e-5 * float(want_k.abs().max())
    # one tensor as source and destination, a row both read and written (a shift by one)
    c1 = randn_nonzero(10, 2, 32, device=device)
    w1 = c1.clone()
    w1[[2, 3, 4]] = c1[[1, 2, 3]]
    ragattn.copy_kv_([c1], [], [c1], [], torch.tensor([1, 2, 3], device=device), torch.tensor([2, 3, 4], device=device))
    assert torch.equal(c1, w1)
    # the same layers as source and destination (a copy on write between pages of one pool):
    # rows permuted among themselves (each read row is also written) and disjoint row sets
    for s_rows, d_rows in (([1, 2, 3], [3, 1, 2]), ([0, 5, 6, 9], [7, 1, 4, 2])):
        ck, cv = randn_nonzero(10, 2, 32, device=device), randn_nonzero(10, 2, 32, device=device)
        wk, wv = ck.clone(), cv.clone()
        d4 = rand_delta(len(s_rows), device, max_abs=100)
        wk[d_rows] = ref.rope_rotate(ck[s_rows], d4, f, 32, compute_dtype=torch.float32)
        wv[d_rows] = cv[s_rows]
        ragattn.copy_kv_([ck], [cv], [ck], [cv], torch.tensor(s_rows, device=device),
                         torch.tensor(d_rows, device=device), d4, f, 32)
        assert torch.equal(cv, wv), (s_rows, d_rows)
        assert max_abs_err(ck, wk) <= 1e-5 * float(wk.abs().max()), (s_rows, d_rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", ["wrapper", "torch.ops", "meta"])
def test_overlapping_written_layers_refused(device, monkeypatch, backend, entry):
    """Written layers that share memory are refused by name on every backend and in the fake impl
    (rerotate_keys_ rotated the shared rows twice); nothing is written."""
    use_kernel_backend(monkeypatch, device, backend)
    dev = torch.device("meta") if entry == "meta" else device
    fn_r = ragattn.rerotate_keys_ if entry == "wrapper" else torch.ops.ragattn.rerotate_keys_
    fn_c = ragattn.copy_kv_ if entry == "wrapper" else torch.ops.ragattn.copy_kv_
    cache = randn_nonzero(12, 2, 32, device=device).to(dev)
    before = cache.clone()
    f = inv_freq_for(32).to(dev)
    rows, delta = torch.tensor([0, 1, 2], device=dev), torch.tensor([5, 6, 7], dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match=r"ragattn.rerotate_keys_: k_layers\[1\] shares memory with k_layers\[0\]"):
        fn_r([cache[0:8], cache[4:12]], rows, delta, f, 32, False)
    src = randn_nonzero(4, 2, 32, device=device).to(dev)
    with pytest.raises(ValueError, match=r"ragattn.copy_kv_: dst_v\[0\] shares memory with dst_k\[0\]"):
        fn_c([cache[0:8]], [cache[3:11]], [src], [src], rows, rows)
    if entry != "meta":
        assert torch.equal(cache, before)
    # K and V views of one FlashInfer cache interleave in memory but never share an element: accepted
    fi = randn_nonzero(3, 2, 4, 2, 32, device=device).to(dev)
    fn_c([fi[:, 0]], [fi[:, 1]], [src], [src], rows, torch.tensor([0, 5, 11], device=dev))
    fn_r([fi[:, 0], fi[:, 1]], rows, delta, f, 32, False)


def test_engine_layouts_opcheck(device):
    """opcheck (schema, fake impl, autograd registration) with strided engine views and int32 rows."""
    fi = randn_nonzero(3, 2, 4, 2, 32, device=device)
    vl = randn_nonzero(2, 3, 4, 2, 32, device=device)
    src = make_layers(2, (5, 2, 32), torch.float32, device)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32, device=device)
    dst = torch.tensor([11, 3, 6], dtype=torch.int32, device=device)
    delta = torch.tensor([7, -3, 100], dtype=torch.int32, device=device)
    f = inv_freq_for(32).to(device)
    torch.library.opcheck(torch.ops.ragattn.copy_kv_.default, ([fi[:, 0]], [fi[:, 1]], src[:1], src[1:], rows, dst, delta, f, 32, False))
    torch.library.opcheck(torch.ops.ragattn.copy_kv_.default, ([vl[0]], [vl[1]], src[:1], src[1:], rows, dst))
    torch.library.opcheck(torch.ops.ragattn.rerotate_keys_.default, ([fi[:, 0], fi[:, 1]], dst, delta, f, 32, True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_mode(device, seed, monkeypatch, backend):
    """Serving code runs under torch.inference_mode(): both ops, every path."""
    use_kernel_backend(monkeypatch, device, backend)
    with torch.inference_mode():
        layers = make_layers(2, (20, 2, 64), torch.float32, device)
        before = [t.clone() for t in layers]
        rows, delta, f = rand_rows(20, 9, device), rand_delta(9, device), inv_freq_for(64).to(device)
        ragattn.rerotate_keys_(layers, rows, delta, f, 64, False)
        check_rotated(layers, before, rows, delta, f, 64, False)
        dst = make_layers(2, (20, 2, 64), torch.float32, device)
        ragattn.copy_kv_(dst, [], layers, [], rows, rows.flip(0), delta, f, 64, False)
        ragattn.copy_kv_(layers, [], layers, [], rows[:3], rows[3:6])  # aliased: staged


def test_layer_pointers_travel_in_the_kernel_parameters(tmp_path):
    """The layer base pointers are a ``__grid_constant__`` kernel parameter (captured by
    value in a CUDA graph), not a device table filled per call from a recycled pinned host buffer
    (a graph replay would copy whatever that buffer held by then). Static check for sm_90a with
    nvcc alone: every kernel takes one parameter block that holds the whole pointer table, and the
    ATen launchers copy nothing host-to-device."""
    import re
    import shutil
    import subprocess
    from pathlib import Path

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    root = Path(__file__).resolve().parents[2]
    ptx = tmp_path / "kv_cache_kernels.ptx"
    subprocess.run([nvcc, "-gencode=arch=compute_90a,code=compute_90a", "-std=c++17", "-O3", "--expt-relaxed-constexpr",
                    f"-I{root / 'csrc'}", "-ptx", str(root / "csrc/kv_cache/kv_cache_kernels.cu"), "-o", str(ptx)],
                   check=True, capture_output=True, timeout=600)
    header = (root / "csrc/kv_cache/kv_cache_kernels.cuh").read_text()
    max_ptrs = int(re.search(r"kMaxLayerPtrs = (\d+);", header).group(1))
    entries = re.findall(r"\.entry (\w+)\(\s*((?:\.param[^\n]*\n?\s*)+)\)", ptx.read_text())
    assert len(entries) >= 2, "no kernel entries found"
    for name, params in entries:
        sizes = [int(s) for s in re.findall(r"\.param \.align \d+ \.b8 \w+\[(\d+)\]", params)]
        assert len(sizes) == 1 and params.count(".param") == 1, (name, params)
        assert sizes[0] >= 8 * max_ptrs, (name, sizes)   # the pointer table is inside the parameter
    for launcher in (root / "csrc/kv_cache").glob("*_cuda.cu"):
        text = launcher.read_text()
        for word in ("pinned_memory", "non_blocking", "cudaMemcpy"):
            assert word not in text, (launcher.name, word)


_HUGE_ROWS = r"""
import torch
import ragattn
from ragattn.reference import kv_cache as ref
from tests.helpers import huge_rows

g = torch.Generator().manual_seed(0)
k, src = torch.randn(4, 2, 16, generator=g).half(), torch.randn(4, 2, 16, generator=g).half()
inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
rows, delta = torch.tensor([0, 2, 3]), torch.tensor([5, -7, 1000], dtype=torch.int32)
want = k.clone()
ref.rerotate_keys_([want], rows, delta, inv_freq, 16, False)
got = huge_rows(k)
ragattn.rerotate_keys_([got], rows, delta, inv_freq, 16, False)
assert (got.float() - want.float()).abs().max() < 2e-3, "rerotate_keys_"
dst_rows = torch.tensor([3, 0, 2])
want_k, want_v = k.clone(), k.clone()
ref.copy_kv_([want_k], [want_v], [src], [src], rows, dst_rows)
got_k, got_v = huge_rows(k), huge_rows(k)
ragattn.copy_kv_([got_k], [got_v], [huge_rows(src)], [huge_rows(src)], rows, dst_rows)
assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), "copy_kv_"
print("compiled")  # run_compile_check's success marker
"""


def test_rows_past_2_31_elements():
    """Cache rows past 2^31 elements (a row stride of 2^30 over virtual storage) on
    the C++ path, whose row offsets (csrc/kv_cache/row_layout.h, shared with the CUDA kernels) are
    int64. A subprocess, so a crash is a failure."""
    from tests.helpers import run_compile_check

    run_compile_check(_HUGE_ROWS, timeout=300)


# ---- Engine conventions (int64 deltas, num_kv_heads against head-major pages) ----


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_delta_matches_int32(device, seed, monkeypatch, backend):
    """vLLM's positions are int64: an int64 delta gives bit-identical results to the same int32 one,
    in both ops, on every path."""
    use_kernel_backend(monkeypatch, device, backend)
    f = inv_freq_for(64).to(device)
    layers = make_layers(2, (31, 3, 64), torch.bfloat16, device)
    rows, delta = rand_rows(31, 17, device), rand_delta(17, device)
    a, b = [t.clone() for t in layers], [t.clone() for t in layers]
    ragattn.rerotate_keys_(a, rows, delta, f, 64, False)
    ragattn.rerotate_keys_(b, rows, delta.long(), f, 64, False)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    check_rotated(b, layers, rows, delta, f, 64, False)
    dst = rand_rows(31, 17, device)
    ka, kb = make_layers(2, (31, 3, 64), torch.bfloat16, device), None
    kb = [t.clone() for t in ka]
    ragattn.copy_kv_(ka, [], layers, [], rows, dst, delta, f, 64, True)
    ragattn.copy_kv_(kb, [], layers, [], rows, dst, delta.long(), f, 64, True)
    assert all(torch.equal(x, y) for x, y in zip(ka, kb))


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_delta_beyond_int32(device, monkeypatch, backend):
    """int64 deltas outside int32 are used as they are (no wrap): the rotation by 2^33 + 5 matches
    the float64 reference; the same value wrapped to int32 (5) would not."""
    use_kernel_backend(monkeypatch, device, backend)
    f = inv_freq_for(64, base=500000.0).to(device)
    x = randn_nonzero(3, 2, 64, device=device)
    delta = torch.tensor([(1 << 33) + 5, -(1 << 32) - 77, 5], dtype=torch.int64, device=device)
    layer = x.clone()
    ragattn.rerotate_keys_([layer], torch.arange(3, device=device), delta, f, 64, False)
    r64 = ref.rope_rotate(x.double(), delta, f, 64, False)
    assert max_abs_err(layer, r64) <= 1e-4 * float(r64.abs().max())
    wrapped = ref.rope_rotate(x.double(), delta.to(torch.int32), f, 64, False)
    assert max_abs_err(wrapped[:2], r64[:2]) > 1e-2


@pytest.mark.parametrize("entry", ["wrapper", "op", "meta"])
def test_num_kv_heads_refuses_head_major_pages(device, entry):
    """A raw HND cache [pages, H, page_size, D] passed as NHD rows would be read with page_size as H;
    with num_kv_heads the ops refuse it by name, caches untouched; the per-head views are accepted."""
    dev = "meta" if entry == "meta" else device
    fn_r = ragattn.rerotate_keys_ if entry == "wrapper" else torch.ops.ragattn.rerotate_keys_
    fn_c = ragattn.copy_kv_ if entry == "wrapper" else torch.ops.ragattn.copy_kv_
    H, ps, D = 2, 16, 32
    hnd = randn_nonzero(3, H, ps, D, device=device).to(dev)  # [pages, H, page_size, D]
    before = hnd.clone()
    f = inv_freq_for(D).to(dev)
    rows, delta = torch.tensor([0, 4, 7], device=dev), torch.tensor([3, -1, 9], dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match=r"ragattn.rerotate_keys_: k_layers\[0\] .* has 16 heads .* num_kv_heads=2"):
        fn_r([hnd], rows, delta, f, D, False, num_kv_heads=H)
    src = randn_nonzero(8, H, D, device=device).to(dev)
    rows_like_hnd = randn_nonzero(8, ps, D, device=device).to(dev)  # rows "[16, 32]" as the HND page reads
    with pytest.raises(ValueError, match=r"ragattn.copy_kv_: dst_k\[0\] .* has 16 heads .* num_kv_heads=2"):
        fn_c([hnd], [], [rows_like_hnd], [], rows, rows, num_kv_heads=H)
    with pytest.raises(ValueError, match=r"ragattn.copy_kv_: dst_k\[0\] .* has 2 heads .* num_kv_heads=3"):
        fn_c([src], [], [src], [], rows, rows, num_kv_heads=3)
    if entry != "meta":
        assert torch.equal(hnd, before)
    # the per-head token-major views of the same pages are what the ops take
    heads = [hnd[:, h:h + 1].transpose(1, 2) for h in range(H)]  # [pages, page_size, 1, D] each
    fn_r(heads, rows, delta, f, D, False, num_kv_heads=1)
    fn_c(heads[:1], [], [src[:, :1]], [], rows, rows, num_kv_heads=1)


def test_engine_args_opcheck(device):
    """opcheck with an int64 delta and num_kv_heads (schema defaults stay backward compatible)."""
    f = inv_freq_for(32).to(device)
    layers = make_layers(2, (12, 2, 32), torch.float32, device)
    rows = torch.tensor([3, 0, 11], device=device)
    delta = torch.tensor([7, -3, (1 << 31) + 100], dtype=torch.int64, device=device)
    torch.library.opcheck(torch.ops.ragattn.rerotate_keys_.default, (layers, rows, delta, f, 32, False, 2))
    dk, sk = make_layers(2, (10, 2, 32), torch.float32, device), make_layers(2, (12, 2, 32), torch.float32, device)
    dst = torch.tensor([9, 2, 4], device=device)
    torch.library.opcheck(torch.ops.ragattn.copy_kv_.default, (dk, [], sk, [], rows, dst, delta, f, 32, True, 2))
