"""ragattn.ops.backend: the backend each op gets, per op, device and RAGATTN_CPU_BACKEND (the
table in the module's docstring), and that every op asks it."""
import pathlib

import pytest
import torch

from ragattn import _extension
from ragattn.ops import backend as B

F32, F64 = torch.float32, torch.float64
KERNEL_FAMILY = ("paged_attention", "paged_attention_run", "merge_attention_states", "key_attention_scores")
CPP_OPS = ("rerotate_keys_", "copy_kv_", "verify_draft")
ENVS = ("", "default", "reference", "triton", "twin")


def _expected(op, device, env, dtype=F32, head_dim=64):
    """The documented table, written out case by case."""
    env = env or "default"
    if op in KERNEL_FAMILY:
        if device == "cuda":
            return "triton"
        return {"default": "cpp", "twin": "cpp", "reference": "reference", "triton": "triton"}[env]
    if op == "varlen_attention":
        if device == "cpu" and dtype != F64 and env in ("default", "twin"):
            return "cpp"
        if dtype == F64 or head_dim > 256:
            return "reference"
        if device == "cuda":
            return "triton"
        return "triton" if env == "triton" else "reference"
    if op == "refrag_assemble":
        if dtype == F64:
            return "reference"
        return "triton" if device == "cuda" or env == "triton" else "reference"
    assert op in CPP_OPS
    if device == "cuda":
        return "cuda" if op in _extension.NATIVE_CUDA_OPS else "reference"
    if env == "reference":
        return "reference"
    return "twin" if (env == "twin" and op == "verify_draft") else "cpp"


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("op", B.OPS)
def test_every_op_device_and_env(monkeypatch, op, device, env):
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", env)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for dtype, head_dim in ((F32, 64), (torch.float16, 128), (F64, 64), (F32, 512)):
        want = _expected(op, device, env, dtype, head_dim)
        assert B.choose(op, device, dtype, head_dim) == want, (op, device, env, dtype, head_dim)


def test_ops_are_the_op_surface():
    assert set(B.OPS) == set(KERNEL_FAMILY + CPP_OPS + ("varlen_attention", "refrag_assemble"))


@pytest.mark.parametrize("op", B.OPS)
def test_bad_env_raises_on_cpu_only(monkeypatch, op):
    """RAGATTN_CPU_BACKEND is read for CPU tensors (a value that is not a backend raises there)
    and never for CUDA tensors; triton needs the interpreter."""
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", "nope")
    with pytest.raises(ValueError, match="RAGATTN_CPU_BACKEND must be one of"):
        B.choose(op, "cpu", F32, 64)
    B.choose(op, "cuda", F32, 64)
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        B.choose(op, "cpu", F32, 64)


def test_float64_cpu_reads_no_environment(monkeypatch):
    """varlen_attention and refrag_assemble decide float64 CPU calls without reading the environment."""
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", "nope")
    assert B.choose("varlen_attention", "cpu", F64, 64) == "reference"
    assert B.choose("refrag_assemble", "cpu", F64) == "reference"


def test_missing_cuda_kernels_are_the_fallbacks():
    from ragattn.ops import _cuda_fallback

    missing = B.missing_cuda_kernels("CUDA")
    assert missing == ()   # ragattn.ops._cuda_fallback registered every one without a kernel
    assert set(_extension.CUDA_CPP_OPS) - set(_extension.NATIVE_CUDA_OPS) <= set(_cuda_fallback.FALLBACKS)


@pytest.mark.parametrize("flag, rows, want", [(None, 1, False), (None, 5, True), ("auto", 1, False), ("auto", 2, True),
                                              ("1", 1, True), ("0", 9, False)])
def test_cpu_sdpa_route(monkeypatch, flag, rows, want):
    if flag is None:
        monkeypatch.delenv(B.CPU_SDPA_ENV, raising=False)
    else:
        monkeypatch.setenv(B.CPU_SDPA_ENV, flag)
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", "reference")   # the route does not follow it
    assert B.cpu_sdpa_enabled(rows) is want


def test_no_op_module_reads_the_environment_itself():
    """The chooser is the one reader of RAGATTN_CPU_BACKEND among the op modules."""
    ops = pathlib.Path(B.__file__).parent
    readers = [p.name for p in ops.glob("*.py") if p.name != "backend.py" and "cpu_backend(" in p.read_text()]
    assert readers == []
