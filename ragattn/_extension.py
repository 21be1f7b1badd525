"""Loads the compiled extension ``ragattn._C`` (which registers every ``torch.ops.ragattn`` schema)."""
from __future__ import annotations

import os

import torch  # noqa: F401  (loads libtorch before the extension links against it)

try:
    from ragattn import _C  # noqa: F401  (import registers the schemas and the C++ kernels)
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "ragattn: the compiled extension ragattn._C is missing or was built against another torch. "
        "Build it with `pip install --no-build-isolation --no-deps -e .` in the repository root."
    ) from exc

# The C++ ops with CUDA kernels, and those of them this build of ragattn._C registered (none when it
# was built without nvcc, e.g. against PyPI's CUDA torch on a machine without the CUDA toolkit:
# setup.py). Read before ragattn.ops._cuda_fallback registers its reference path for the others.
CUDA_CPP_OPS = ("rerotate_keys_", "copy_kv_", "verify_draft")
NATIVE_CUDA_OPS = tuple(op for op in CUDA_CPP_OPS
                        if torch._C._dispatch_has_kernel_for_dispatch_key(f"ragattn::{op}", "CUDA"))

# Which path CPU tensors take (design.md, "Backends"):
#   "default":   C++ ops run their CPU C++ twin; Triton-backed ops their CPU path (a C++ CPU kernel,
#                torch's fused CPU attention or the reference: docs/ops.md, "Backends")
#   "reference": every op runs the plain-torch reference in ragattn.reference
#   "triton":    Triton-backed ops run their Triton kernel under TRITON_INTERPRET=1
#   "twin":      C++ ops whose default CPU path is not their CUDA kernel's bit-faithful twin
#                (verify_draft) run that twin instead; others as "default"
# ragattn.ops.backend turns this into each op's backend (the one place an op chooses).
CPU_BACKENDS = ("default", "reference", "triton", "twin")


def cpu_backend() -> str:
    """The backend CPU tensors use, from ``RAGATTN_CPU_BACKEND`` (read on every call)."""
    value = os.environ.get("RAGATTN_CPU_BACKEND", "").strip().lower() or "default"
    if value not in CPU_BACKENDS:
        raise ValueError(f"ragattn: RAGATTN_CPU_BACKEND must be one of {CPU_BACKENDS}, got {value!r}")
    if value == "triton" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            "ragattn: RAGATTN_CPU_BACKEND=triton runs Triton kernels on CPU tensors, which needs "
            "TRITON_INTERPRET=1 set before triton_kernels is imported"
        )
    return value
