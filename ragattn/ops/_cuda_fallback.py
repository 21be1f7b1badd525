"""CUDA impls of the C++ ops for an extension built without its CUDA kernels.

``setup.py`` builds the CPU kernels only when torch has CUDA but no CUDA toolkit (nvcc) is found
(PyPI's default Linux torch on a stock machine). Then ``rerotate_keys_``, ``copy_kv_`` and
``verify_draft`` have no CUDA kernel; this module registers their plain-torch reference
(``ragattn.reference``, rotation and softmax in float32 as the kernels compute them) as their
CUDA impl, so CUDA tensors work, slower, with a one-time warning. The Triton ops are unaffected.
Where the extension has its CUDA kernels nothing is registered; which ops lack one is
``ragattn.ops.backend.missing_cuda_kernels`` (``backend.choose`` answers "reference" for them).

    register(dispatch_key="CUDA") -> the ops registered (run at import)
"""
from __future__ import annotations

import warnings

import torch

from ragattn.ops import backend, kv_cache as _kv
from ragattn.ops.verify_draft import _validate as _validate_verify_draft
from ragattn.reference import kv_cache as _ref_kv
from ragattn.reference.speculative import verify_draft as _ref_verify_draft

_warned = False


def _warn_once(op: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"ragattn.{op}: ragattn._C was built without its CUDA kernels (no CUDA toolkit at build "
            "time), so rerotate_keys_, copy_kv_ and verify_draft run their plain-torch reference on "
            "CUDA tensors (correct, slower). Install the CUDA toolkit (nvcc) and rebuild ragattn "
            "(`pip install --no-build-isolation --no-deps .`) for the CUDA kernels.",
            RuntimeWarning, stacklevel=3)


def rerotate_keys_cuda(k_layers, rows, delta, inv_freq, rotary_dim, interleaved, num_kv_heads=None, k_scale=None):
    _warn_once("rerotate_keys_")
    if _kv._validate_rerotate(k_layers, rows, delta, inv_freq, rotary_dim, num_kv_heads, k_scale) is not None:
        _ref_kv.rerotate_keys_(list(k_layers), rows, delta, inv_freq, int(rotary_dim), bool(interleaved),
                               compute_dtype=torch.float32, k_scale=k_scale)


def copy_kv_cuda(dst_k, dst_v, src_k, src_v, src_rows, dst_rows, delta=None, inv_freq=None, rotary_dim=0,
                 interleaved=False, num_kv_heads=None, src_k_scale=None, src_v_scale=None, dst_k_scale=None,
                 dst_v_scale=None):
    _warn_once("copy_kv_")
    scales = dict(src_k_scale=src_k_scale, src_v_scale=src_v_scale, dst_k_scale=dst_k_scale, dst_v_scale=dst_v_scale)
    gk, _ = _kv._validate_copy(dst_k, dst_v, src_k, src_v, src_rows, dst_rows, delta, inv_freq, rotary_dim,
                               num_kv_heads, **scales)
    if gk is not None:
        _ref_kv.copy_kv_(list(dst_k), list(dst_v), list(src_k), list(src_v), src_rows, dst_rows, delta, inv_freq,
                         int(rotary_dim), bool(interleaved), compute_dtype=torch.float32, **scales)


def verify_draft_cuda(draft_tokens, draft_probs, target_logits, uniforms, temperature=1.0, eta=0.0, alpha=0.1,
                      greedy=False, num_draft=None, cu_num_draft=None):
    _warn_once("verify_draft")
    _validate_verify_draft(draft_tokens, draft_probs, target_logits, uniforms, temperature, eta, alpha, num_draft,
                    cu_num_draft)
    return _ref_verify_draft(draft_tokens, draft_probs, target_logits, uniforms, temperature, eta, alpha, greedy,
                             num_draft, cu_num_draft=cu_num_draft)


FALLBACKS = {"rerotate_keys_": rerotate_keys_cuda, "copy_kv_": copy_kv_cuda, "verify_draft": verify_draft_cuda}
_lib = None


def register(dispatch_key: str = "CUDA") -> tuple:
    """Register the reference impl of each C++ op the extension has no ``dispatch_key`` kernel
    for; returns the ops registered (idempotent: a second call registers nothing)."""
    global _lib
    missing = backend.missing_cuda_kernels(dispatch_key)
    if missing and _lib is None:
        _lib = torch.library.Library("ragattn", "IMPL")
    for op in missing:
        _lib.impl(op, FALLBACKS[op], dispatch_key)
    return missing


register()
