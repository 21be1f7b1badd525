"""The one place each op chooses its backend, per op and device (design.md, "Backends").

CUDA tensors run the Triton kernel or, for the C++ ops, their CUDA kernel (the plain-torch
reference, with a one-time warning, where ``ragattn._C`` was built without nvcc). CPU tensors
follow ``RAGATTN_CPU_BACKEND`` (read on every call: ``default``, ``reference``, ``triton`` under
``TRITON_INTERPRET=1``, ``twin``; ``ragattn._extension.cpu_backend`` refuses any other value).
The request caches' CPU decode/prefill steps may attend with torch's SDPA over their slots in
place instead of the paged op (``RAGATTN_HF_CPU_SDPA``: :func:`cpu_sdpa_enabled`).

    from ragattn.ops import backend
    backend.choose("paged_attention", q.device.type)              # "triton" | "cpp" | "reference"
    backend.choose("varlen_attention", "cpu", q.dtype, q.shape[-1])
    backend.missing_cuda_kernels()      # the C++ ops that run the reference on CUDA tensors
    backend.cpu_sdpa_enabled(q_rows)    # the copy path's CPU route through SDPA

Backends: ``TRITON`` (the Triton kernel), ``CUDA`` (a C++ op's CUDA kernel), ``CPP`` (the C++
CPU kernel; varlen_attention's default CPU path: its C++ kernels or torch's fused attention over
dense sequences), ``TWIN`` (verify_draft's bit-faithful CPU twin of its CUDA kernel),
``REFERENCE`` (``ragattn.reference``, float64-capable).

| op | CUDA | CPU default / twin | CPU reference | CPU triton |
|---|---|---|---|---|
| paged_attention, paged_attention_run, merge_attention_states, key_attention_scores | triton | cpp | reference | triton |
| varlen_attention (fp16/bf16/fp32, head_dim <= 256) | triton | cpp | reference | triton |
| varlen_attention (fp64 or head_dim > 256) | reference | reference | reference | reference |
| refrag_assemble (not fp64) | triton | reference | reference | triton |
| rerotate_keys_, copy_kv_ | cuda (reference without nvcc) | cpp | reference | cpp |
| verify_draft | cuda (reference without nvcc) | cpp / twin | reference | cpp |
"""
from __future__ import annotations

import os

import torch

from ragattn import _extension

TRITON, CUDA, CPP, TWIN, REFERENCE = "triton", "cuda", "cpp", "twin", "reference"

MAX_TRITON_HEAD_DIM = 256  # varlen_attention's kernels pad head_dim to the next power of two (>= 16)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

CPU_SDPA_ENV = "RAGATTN_HF_CPU_SDPA"


def cpu_backend() -> str:
    """``RAGATTN_CPU_BACKEND`` (read now; ValueError on a value that is not a backend)."""
    return _extension.cpu_backend()


def _kernel_family(device_type: str, dtype, head_dim) -> str:
    """Ops with a Triton kernel and a C++ CPU kernel."""
    if device_type != "cpu":
        return TRITON
    env = cpu_backend()
    return env if env in (TRITON, REFERENCE) else CPP


def _varlen(device_type: str, dtype, head_dim) -> str:
    # (the order of the reads as the op made them: a CPU float64 call never reads the environment)
    if device_type == "cpu" and dtype in _FLOAT_DTYPES and cpu_backend() in ("default", "twin"):
        return CPP
    if dtype == torch.float64 or (head_dim or 0) > MAX_TRITON_HEAD_DIM:
        return REFERENCE
    if device_type == "cuda":
        return TRITON
    return TRITON if device_type == "cpu" and cpu_backend() == TRITON else REFERENCE


def _refrag(device_type: str, dtype, head_dim) -> str:
    if dtype == torch.float64:
        return REFERENCE
    return TRITON if device_type == "cuda" or cpu_backend() == TRITON else REFERENCE


def _cpp_op(op: str):
    def rule(device_type: str, dtype, head_dim) -> str:
        if device_type == "cpu":
            env = cpu_backend()
            if env == REFERENCE:
                return REFERENCE
            return TWIN if env == TWIN and op == "verify_draft" else CPP
        return CUDA if op in _extension.NATIVE_CUDA_OPS else REFERENCE
    return rule


_RULES = {
    "paged_attention": _kernel_family,
    "paged_attention_run": _kernel_family,
    "merge_attention_states": _kernel_family,
    "key_attention_scores": _kernel_family,
    "varlen_attention": _varlen,
    "refrag_assemble": _refrag,
    **{op: _cpp_op(op) for op in _extension.CUDA_CPP_OPS},
}
OPS = tuple(_RULES)


def choose(op: str, device_type: str, dtype: torch.dtype | None = None, head_dim: int | None = None) -> str:
    """The backend of ``op`` for tensors on ``device_type`` ("cpu", "cuda") of ``dtype`` and
    ``head_dim`` (where the op's choice depends on them: varlen_attention, refrag_assemble), as
    the table above; reads ``RAGATTN_CPU_BACKEND`` for CPU tensors."""
    return _RULES[op](device_type, dtype, head_dim)


def missing_cuda_kernels(dispatch_key: str = "CUDA") -> tuple:
    """The C++ ops with no ``dispatch_key`` kernel in this build of ``ragattn._C`` (none where it
    was built with nvcc): ``ragattn.ops._cuda_fallback`` registers their reference there."""
    return tuple(op for op in _extension.CUDA_CPP_OPS
                 if not torch._C._dispatch_has_kernel_for_dispatch_key(f"ragattn::{op}", dispatch_key))


def cpu_sdpa_enabled(q_rows: int) -> bool:
    """Whether a CPU paged step of ``q_rows`` new tokens per row (a request cache whose rows own
    consecutive pages) attends with torch's SDPA over the row's slots in place (same rule: slot
    ``j`` visible to a query at slot ``s`` iff ``j <= s``, ``j < kv_lens``) rather than
    ``paged_attention``'s C++ kernel (``ragattn.kv.cpu_sdpa``). By default a decode step (one row)
    takes the kernel (it reads each row of the paged layout once for the whole GQA group) and a
    longer step (a final block's prefill, masked) takes SDPA. ``RAGATTN_HF_CPU_SDPA=1`` forces
    SDPA, ``=0`` the kernel, for every step; ``RAGATTN_CPU_BACKEND`` does not change it."""
    flag = os.environ.get(CPU_SDPA_ENV)
    if flag is None or flag == "auto":
        return q_rows > 1
    return flag != "0"
