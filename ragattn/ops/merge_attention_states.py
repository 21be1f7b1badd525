"""``ragattn.merge_attention_states``: exact merge of two partial attentions."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ragattn import _extension
from ragattn.ops._validate import FLOAT_DTYPES, check_no_overlap, check_same_device, check_tensor, device_guard
from ragattn.reference.merge_attention_states import merge_attention_states as _reference

_OP = "merge_attention_states"


def _validate(out_a, lse_a, out_b, lse_b, out=None, lse_out=None) -> None:
    """Every check of the op (none reads tensor contents: the fake impl runs the same checks)."""
    check_tensor(_OP, "out_a", out_a, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor(_OP, "out_b", out_b, dtypes=(out_a.dtype,), shape=tuple(out_a.shape))
    check_tensor(_OP, "lse_a", lse_a, dtypes=(torch.float32,), shape=tuple(out_a.shape[:2]))
    check_tensor(_OP, "lse_b", lse_b, dtypes=(torch.float32,), shape=tuple(out_a.shape[:2]))
    check_same_device(_OP, out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    if out is not None or lse_out is not None:
        check_tensor(_OP, "out", out, dtypes=(out_a.dtype,), shape=tuple(out_a.shape), device=out_a.device)
        check_tensor(_OP, "lse_out", lse_out, dtypes=(torch.float32,), shape=tuple(out_a.shape[:2]), device=out_a.device)
        check_no_overlap(_OP, {"out": out, "lse_out": lse_out}, dict(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b))


def merge_attention_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    lse_out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial attentions of the same queries over disjoint key sets.

    Args:
        out_a, out_b: ``[N, num_heads, head_dim]`` fp16/bf16/fp32 (same dtype), each normalised over its own keys.
        lse_a, lse_b: float32 ``[N, num_heads]``, natural-log sum of exp of the scores over each key set.
        out, lse_out: optional preallocated outputs (``[N, num_heads, head_dim]`` in out_a's dtype,
            float32 ``[N, num_heads]``, any strides, not overlapping an input); returned when given.

    Returns:
        out ``[N, num_heads, head_dim]`` in out_a's dtype and lse float32 ``[N, num_heads]`` with
        ``lse = log(exp(lse_a) + exp(lse_b))`` and ``out = (exp(lse_a) out_a + exp(lse_b) out_b) / exp(lse)``:
        attention over the union of the key sets (cascade attention: shared chunk pages + private
        pages).

    Edge rule, the same on every backend (reference, Triton kernel, interpreter):

    * an lse of ``-inf`` or ``+inf`` means that side saw no key (``+inf`` is FlashAttention's
      marker for such rows; ragattn's own kernels write ``-inf``): it contributes nothing and its
      out is never read (it may hold garbage or NaN). Both sides empty: out 0, lse ``-inf``.
    * an lse of NaN makes that (row, head) NaN in out and lse.
    * a side that is read contributes all of its values, even where its weight underflows to 0:
      a non-finite value in it makes that element of out NaN (never a finite number).

    Backends: CUDA runs the Triton kernel (one program per row, all heads); CPU a C++ loop over
    (row, head) with the same weights (``csrc/attention/``), the reference with
    ``RAGATTN_CPU_BACKEND=reference``, or the Triton kernel under the interpreter with
    ``RAGATTN_CPU_BACKEND=triton``.
    """
    if out is None and lse_out is None:
        return torch.ops.ragattn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    if out is None:
        out = out_a.new_empty(out_a.shape)
    if lse_out is None:
        lse_out = lse_a.new_empty(lse_a.shape, dtype=torch.float32)
    torch.ops.ragattn.merge_attention_states.out(out_a, lse_a, out_b, lse_b, out=out, lse_out=lse_out)
    return out, lse_out


def _run(out_a, lse_a, out_b, lse_b, out=None, lse_out=None):
    _validate(out_a, lse_a, out_b, lse_b, out, lse_out)
    use_triton = out_a.device.type == "cuda" or _extension.cpu_backend() == "triton"
    if use_triton:
        from ragattn.triton_kernels.merge_attention_states import merge_two_states

        # the kernel stores with a unit last-dim stride: anything else goes through a temporary
        out_k = out if out is not None and out.stride(-1) == 1 else None
        lse_k = lse_out if lse_out is not None and lse_out.stride(-1) == 1 else None
        with device_guard(out_a):
            o, lse = merge_two_states(out_a, lse_a, out_b, lse_b, out_k, lse_k)
    elif _extension.cpu_backend() == "reference":
        o, lse = _reference(out_a, lse_a, out_b, lse_b)
    else:  # the C++ kernel (csrc/attention/merge_attention_states_cpu.cpp): one pass, any row/head strides
        out_a = out_a if out_a.stride(-1) == 1 else out_a.contiguous()
        out_b = out_b if out_b.stride(-1) == 1 else out_b.contiguous()
        o = out if out is not None and out.stride(-1) == 1 else out_a.new_empty(out_a.shape)
        lse = lse_out if lse_out is not None else lse_a.new_empty(lse_a.shape)
        torch.ops.ragattn._merge_attention_states_cpu(out_a, lse_a, out_b, lse_b, out=o, lse_out=lse)
    if out is None:
        return o, lse
    if o is not out:
        out.copy_(o)
    if lse is not lse_out:
        lse_out.copy_(lse)
    return out, lse_out


@torch.library.impl("ragattn::merge_attention_states", "CPU")
def _merge_cpu(out_a, lse_a, out_b, lse_b):
    return _run(out_a, lse_a, out_b, lse_b)


@torch.library.impl("ragattn::merge_attention_states", "CUDA")
def _merge_cuda(out_a, lse_a, out_b, lse_b):
    return _run(out_a, lse_a, out_b, lse_b)


@torch.library.impl("ragattn::merge_attention_states.out", "CPU")
def _merge_out_cpu(out_a, lse_a, out_b, lse_b, *, out, lse_out):
    _run(out_a, lse_a, out_b, lse_b, out, lse_out)


@torch.library.impl("ragattn::merge_attention_states.out", "CUDA")
def _merge_out_cuda(out_a, lse_a, out_b, lse_b, *, out, lse_out):
    _run(out_a, lse_a, out_b, lse_b, out, lse_out)


@torch.library.register_fake("ragattn::merge_attention_states")
def _merge_fake(out_a, lse_a, out_b, lse_b):
    _validate(out_a, lse_a, out_b, lse_b)
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape)  # contiguous, like the kernels


@torch.library.register_fake("ragattn::merge_attention_states.out")
def _merge_out_fake(out_a, lse_a, out_b, lse_b, *, out, lse_out):
    _validate(out_a, lse_a, out_b, lse_b, out, lse_out)
