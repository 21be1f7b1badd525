"""Shared test utilities: precision-aware comparison, poisoning, awkward random inputs."""
from __future__ import annotations

import torch

# FlashAttention's rule: the kernel's error against a float64 reference may be at most
# FACTOR times the error of the same computation done in the input dtype (plus a floor for
# the case where the low-precision computation happens to be exact).
FACTOR = 2.0


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``t`` full of NaN (floats) or a sentinel (ints): outputs must overwrite it."""
    out = torch.empty_like(t)
    if out.is_floating_point():
        out.fill_(float("nan"))
    else:
        out.fill_(-12345)
    return out


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| in float64, treating matching infinities as equal and any NaN as infinite error."""
    a64, b64 = a.detach().double(), b.detach().double()
    if torch.isnan(a64).any() or torch.isnan(b64).any():
        return float("inf")
    same_inf = torch.isinf(a64) & torch.isinf(b64) & (torch.sign(a64) == torch.sign(b64))
    diff = (a64 - b64).abs().masked_fill(same_inf, 0.0)
    return float(diff.max()) if diff.numel() else 0.0


def assert_precision(out: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor, *, atol_floor: float | None = None,
                     what: str = "out", factor: float = FACTOR):
    """Assert ``err(out, ref64) <= factor * err(ref_lowp, ref64) + floor``.

    ``ref_lowp`` is the reference computed in the kernel's input dtype; ``floor`` defaults to a
    few units of that dtype's rounding at the reference's magnitude. ``factor`` is FACTOR for one
    kernel; a test of a longer pipeline than its reference says why it allows more.
    """
    kernel_err = max_abs_err(out, ref64)
    base_err = max_abs_err(ref_lowp, ref64)
    if atol_floor is None:
        finite = ref64[torch.isfinite(ref64)]
        scale = float(finite.abs().max()) if finite.numel() else 1.0
        atol_floor = 4 * torch.finfo(out.dtype).eps * max(scale, 1e-6) if out.is_floating_point() else 0.0
    bound = factor * base_err + atol_floor
    assert kernel_err <= bound, (
        f"{what}: error vs float64 reference {kernel_err:.3e} exceeds {factor} x low-precision "
        f"reference error {base_err:.3e} (+ floor {atol_floor:.1e})"
    )


def interpreter_on() -> bool:
    """Whether this process's Triton kernels are interpreter objects, the only ones that run on CPU
    tensors: ``triton.jit`` reads TRITON_INTERPRET when a kernel module is imported, and conftest
    sets it before that only where CUDA is absent. In a process where CUDA is up (a GPU machine,
    or ``RAGATTN_TEST_FAKE_CUDA=1``) the kernels are compiled, and a CPU tensor handed to one fails
    ("Pointer argument cannot be accessed from Triton (cpu tensor?)")."""
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cuda_usable() -> bool:
    """A real CUDA device: ``torch.cuda.is_available()`` without conftest's RAGATTN_TEST_FAKE_CUDA
    stand-in (which makes it True on a machine that cannot make a CUDA tensor)."""
    import os

    return torch.cuda.is_available() and os.environ.get("RAGATTN_TEST_FAKE_CUDA") != "1"


def require_triton_on(device: torch.device) -> None:
    """Skip a test that calls a Triton kernel directly on ``device`` tensors where it cannot run:
    CPU tensors need the interpreter, CUDA tensors a real device."""
    import pytest

    if device.type == "cpu" and not interpreter_on():
        pytest.skip("the Triton kernels of this process are compiled (CUDA is up): CPU tensors need the "
                    "interpreter, which runs where CUDA is absent; --device cuda runs this on CUDA tensors")
    if device.type == "cuda" and not cuda_usable():
        pytest.skip("no usable CUDA device (RAGATTN_TEST_FAKE_CUDA)")


def triton_device() -> torch.device:
    """Where this process's Triton kernels run: CPU tensors under the interpreter, else CUDA
    tensors (skips where neither is possible: compiled kernels without a usable GPU)."""
    if interpreter_on():
        return torch.device("cpu")
    require_triton_on(torch.device("cuda"))
    return torch.device("cuda")


def triton_backend_device() -> torch.device | None:
    """For tests that loop over backends: the device of the "triton" case (CPU tensors through
    RAGATTN_CPU_BACKEND=triton under the interpreter, else the CUDA tensors the compiled kernels
    run on), or None where neither is possible (compiled kernels, no usable GPU)."""
    if interpreter_on():
        return torch.device("cpu")
    return torch.device("cuda") if cuda_usable() else None


def numpy_breaks_interpreter() -> str | None:
    """Why the Triton interpreter cannot run here, or None: triton 3.6's interpreter converts
    1-element arrays to Python ints, which numpy >= 2.4 refuses (requirements.txt pins numpy < 2.4;
    a GPU image need not)."""
    import warnings

    import numpy as np

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)   # numpy 1.25 - 2.3 warn
            int(np.array([1]))
    except TypeError as exc:
        return f"numpy {np.__version__} breaks triton's interpreter ({exc}); requirements.txt pins numpy < 2.4"
    return None


def use_kernel_backend(monkeypatch, device: torch.device, backend: str) -> None:
    """Route the ops' CPU calls: "triton" runs the Triton kernels in the interpreter, "reference"
    the plain-torch references (skipped on CUDA, where there is no such switch), "twin" the
    bit-faithful C++ twins of the CUDA kernels where the default CPU path is another one
    (verify_draft), anything else the default path. CUDA tensors always run their kernels.

    Never sets TRITON_INTERPRET: a ``triton_kernels`` module first imported under it would keep
    interpreted kernels for the whole session, CUDA tensors included (conftest sets it once, only
    without CUDA). So "triton" on CPU tensors skips where CUDA is up (``require_triton_on``).
    """
    if backend == "reference" and device.type != "cpu":
        import pytest

        pytest.skip("CPU backend switch")
    if backend == "triton" and device.type == "cpu":
        require_triton_on(device)
    if backend in ("triton", "reference", "twin") and device.type == "cpu":
        monkeypatch.setenv("RAGATTN_CPU_BACKEND", backend)
    else:
        monkeypatch.delenv("RAGATTN_CPU_BACKEND", raising=False)


def randn_nonzero(*shape, dtype=torch.float32, device="cpu", generator=None) -> torch.Tensor:
    """Standard-normal data shifted away from zero (tests never use zeros as data)."""
    x = torch.randn(*shape, dtype=torch.float32, generator=generator)
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 1e-3), x)
    return x.to(device=device, dtype=dtype)


# ------------------------------------------------------------------------------------------------
# Offline sm_90 compilation of Triton kernels (no GPU needed)
# ------------------------------------------------------------------------------------------------
H100_SHARED_BYTES = 227 * 1024  # max dynamic shared memory per block on sm_90


def compile_sm90(fn, constexprs: dict, types: dict, *, num_warps: int = 4, num_stages: int = 3):
    """Compile the ``@triton.jit`` kernel ``fn`` for an H100 and check its shared memory.

    ``constexprs`` maps constexpr argument names to values; ``types`` maps the other arguments to
    Triton type strings (``"*bf16"``, ``"fp32"``, ...); arguments in neither default to ``"i32"``.
    Pointers and ``stride*`` arguments are marked divisible by 16, as a launch with torch
    allocations and head dims of 64/128/256 specialises them (16-byte vector accesses).
    Must run where ``TRITON_INTERPRET`` is unset (see ``run_compile_check``).
    """
    from ragattn.bench.sm90 import compile_sm90 as compile_for_h100

    compiled = compile_for_h100(fn, constexprs, types, num_warps=num_warps, num_stages=num_stages)
    shared = compiled.metadata.shared
    assert shared <= H100_SHARED_BYTES, f"{fn.__name__} {constexprs}: {shared} B of shared memory > {H100_SHARED_BYTES}"
    return compiled


# The dtype x head-dim matrix the compile checks cover: every head dim in bf16 and fp32 (fp32
# tiles need the most shared memory), fp16 (same code as bf16 but its element type) once.
SM90_CASES = (("bf16", 64), ("bf16", 128), ("bf16", 256), ("fp32", 64), ("fp32", 128), ("fp32", 256), ("fp16", 128))

_JOBS: list = []


def _compile_job(i: int, ptxas: bool = False):
    fn, constexprs, types, options = _JOBS[i]
    compiled = compile_sm90(fn, constexprs, types, **options)
    if ptxas:
        from ragattn.bench.sm90 import ptxas_report

        return ptxas_report(compiled.asm["ptx"])
    return i


def _ptxas_job(i: int):
    return _compile_job(i, ptxas=True)


def compile_many_sm90(jobs, ptxas: bool = False):
    """``compile_sm90(fn, constexprs, types, **options)`` for each ``(fn, constexprs, types, options)``,
    spread over forked worker processes (compilation is CPU-bound and mostly single-threaded).
    With ``ptxas``: returns each job's ``bench.sm90.ptxas_report`` (registers, spills)."""
    import multiprocessing
    import os

    _JOBS[:] = list(jobs)
    job = _ptxas_job if ptxas else _compile_job
    workers = min(len(_JOBS), os.cpu_count() or 1, 8)
    if workers <= 1:
        return [job(i) for i in range(len(_JOBS))]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(job, range(len(_JOBS)), chunksize=1)


def huge_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into a view whose rows lie 2^30 elements apart over virtual storage (rows 2 and
    up start past 2^31 elements; the storage is never touched beyond these rows, so a few pages of
    memory on the CPU; on CUDA the whole span is allocated): for testing int64 row offsets without
    a 2^31-element tensor."""
    big = torch.empty((t.shape[0] - 1) * 2**30 + t[0].numel(), dtype=t.dtype, device=t.device)
    view = torch.as_strided(big, t.shape, (2**30,) + t.stride()[1:])
    view.copy_(t)
    return view


def run_compile_check(code: str, timeout: float = 1500) -> str:
    """Run ``code`` in a fresh Python with the repository on the path and TRITON_INTERPRET unset.

    The timeout is a hang guard, not a speed bound: a cold Triton cache compiles every sm_90
    config, which takes many minutes on a few loaded cores beside an xdist worker.

    This process's kernels are interpreter objects (conftest sets TRITON_INTERPRET=1 without
    CUDA), so GPU compilation happens in a subprocess; ``code`` must print ``compiled`` at the end.
    Returns its stdout.
    """
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RAGATTN_CPU_BACKEND")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def run_offsets_check(code: str, device: torch.device, *, cuda_gib: float, timeout: float = 300) -> None:
    """Run a check of offsets past 2^31 elements in a fresh process (a crash is a failure): on the
    CPU in the interpreter, on CUDA with the compiled kernels. ``code`` makes its tensors on
    ``DEVICE`` (defined before it) and prints ``compiled`` at the end; on CUDA the virtual storage
    of ``huge_rows`` is real memory, ``cuda_gib`` GiB of it at the peak (skipped if not free)."""
    import pytest

    if device.type == "cpu":
        why = numpy_breaks_interpreter()
        if why:
            pytest.skip(why)
        prelude = 'import os\nos.environ["TRITON_INTERPRET"] = "1"\nDEVICE = "cpu"\n'
    else:
        require_triton_on(device)
        free = torch.cuda.mem_get_info()[0] / 2**30
        if free < cuda_gib + 2:
            pytest.skip(f"needs {cuda_gib} GiB of free GPU memory, {free:.1f} GiB free")
        prelude = 'DEVICE = "cuda"\n'
    run_compile_check(prelude + code, timeout=timeout)


def tiny_causal_lm(family: str = "llama", folder=None, seed: int = 0, **overrides):
    """A small random HF causal LM in eval mode (fp32, GQA 4/2 heads, 2 layers, head_dim 16):
    ``family`` "llama", "llama3" (Llama with llama3 RoPE scaling) or "qwen2"; saved (safetensors
    and config) to ``folder`` when given, so that vLLM's ModelConfig and transformers read it."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kw = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
    if family == "llama3":
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    kw.update(overrides)
    torch.manual_seed(seed)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(architectures=["Qwen2ForCausalLM"], **kw))
    else:
        model = LlamaForCausalLM(LlamaConfig(architectures=["LlamaForCausalLM"], **kw))
    model = model.eval()
    if folder is not None:
        model.save_pretrained(folder)
    return model


def run_in_threads(fns) -> list:
    """Run every callable of ``fns`` in a thread of its own, all at once (a ``threading.Barrier``
    of ``len(fns)`` inside them is safe), wait for all of them, and return their results in
    order; a worker's exception is raised here (the first one's, in the order of ``fns``), never
    lost with its thread."""
    from concurrent.futures import ThreadPoolExecutor

    fns = list(fns)
    if not fns:
        return []
    with ThreadPoolExecutor(max_workers=len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
    return [f.result() for f in futures]
