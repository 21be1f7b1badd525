"""``ragattn.merge_attention_states``: exact merge of partial attentions (two, in place, or N-way).

LSE convention: ragattn's LSEs are natural log (``log(sum exp(scores))``, as FlashAttention's);
FlashInfer's are base 2 (``log2``). ``log2=True`` takes and returns base-2 LSEs, so FlashInfer states
merge without conversion; mixing the two conventions without it is wrong by a factor ln 2 = 0.69
in every weight exponent.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from ragattn.ops import backend
from ragattn.ops._validate import FLOAT_DTYPES, check_no_overlap, check_same_device, check_tensor, device_guard
from ragattn.reference.merge_attention_states import merge_attention_states as _reference
from ragattn.reference.merge_attention_states import merge_attention_states_n as _reference_n

_OP = "merge_attention_states"
_OP_ = "merge_attention_states_"
_OPN = "merge_attention_states_n"


def _check_log2(op: str, log2) -> None:
    if not isinstance(log2, bool):
        raise TypeError(f"ragattn.{op}: log2 must be a bool, got {type(log2).__name__}")


def _validate(out_a, lse_a, out_b, lse_b, out=None, lse_out=None, op: str = _OP) -> None:
    """Every check of the op (none reads tensor contents: the fake impl runs the same checks)."""
    check_tensor(op, "out_a", out_a, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor(op, "out_b", out_b, dtypes=(out_a.dtype,), shape=tuple(out_a.shape))
    check_tensor(op, "lse_a", lse_a, dtypes=(torch.float32,), shape=tuple(out_a.shape[:2]))
    check_tensor(op, "lse_b", lse_b, dtypes=(torch.float32,), shape=tuple(out_a.shape[:2]))
    check_same_device(op, out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    if op == _OP_:  # in place into (out_a, lse_a): they are the outputs
        check_no_overlap(op, {"out_a": out_a, "lse_a": lse_a}, dict(out_b=out_b, lse_b=lse_b))
        return
    if out is not None or lse_out is not None:
        check_tensor(op, "out", out, dtypes=(out_a.dtype,), shape=tuple(out_a.shape), device=out_a.device)
        check_tensor(op, "lse_out", lse_out, dtypes=(torch.float32,), shape=tuple(out_a.shape[:2]), device=out_a.device)
        check_no_overlap(op, {"out": out, "lse_out": lse_out}, dict(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b))


def _stack_states(name: str, states, ndim: int) -> torch.Tensor:
    """``states`` as one ``[S, ...]`` tensor: a list of S tensors of one shape, dtype and device is
    stacked (checked here, so a bad list is named rather than failing inside ``torch.stack``)."""
    if not isinstance(states, (list, tuple)):
        return states
    if not states:
        raise ValueError(f"ragattn.{_OPN}: {name} is an empty list; for S = 0 pass a tensor of shape "
                         f"[0, {'N, num_heads, head_dim' if ndim == 3 else 'N, num_heads'}] (a list has no shape)")
    first = states[0]
    for i, t in enumerate(states):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ragattn.{_OPN}: {name}[{i}] must be a tensor, got {type(t).__name__}")
        if t.dim() != ndim or t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"ragattn.{_OPN}: {name}[{i}] is {tuple(t.shape)} {t.dtype} on {t.device}, but {name}[0] "
                             f"is {tuple(first.shape)} {first.dtype} on {first.device}; every state needs the same "
                             f"{ndim}-d shape, dtype and device")
    return torch.stack(list(states))


def _validate_n(outs, lses) -> None:
    check_tensor(_OPN, "outs", outs, dtypes=FLOAT_DTYPES, ndim=4)
    check_tensor(_OPN, "lses", lses, dtypes=(torch.float32,), shape=tuple(outs.shape[:3]))
    check_same_device(_OPN, outs=outs, lses=lses)


def merge_attention_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    lse_out: Optional[torch.Tensor] = None,
    log2: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial attentions of the same queries over disjoint key sets.

    Args:
        out_a, out_b: ``[N, num_heads, head_dim]`` fp16/bf16/fp32 (same dtype), each normalised over its own keys.
        lse_a, lse_b: float32 ``[N, num_heads]`` (any strides, e.g. a transposed ``[H, N]`` buffer's
            ``.t()``), log-sum-exp of the scores over each key set: natural log (ragattn's and
            FlashAttention's convention), or base 2 with ``log2=True`` (FlashInfer's).
        out, lse_out: optional preallocated outputs (``[N, num_heads, head_dim]`` in out_a's dtype,
            float32 ``[N, num_heads]``, any strides, not overlapping an input); returned when given.
        log2: the lses are base 2 (``log2(sum 2^(scores * log2 e))``, FlashInfer's ``lse``), and so
            is the returned one. Passing FlashInfer's base-2 lses without it weighs every side
            wrongly (exponents off by a factor ln 2).

    Returns:
        out ``[N, num_heads, head_dim]`` in out_a's dtype and lse float32 ``[N, num_heads]`` with
        ``lse = log(exp(lse_a) + exp(lse_b))`` and ``out = (exp(lse_a) out_a + exp(lse_b) out_b) / exp(lse)``
        (``log2``/``exp2`` with ``log2=True``): attention over the union of the key sets (cascade
        attention: shared chunk pages + private pages). See also :func:`merge_attention_states_`
        (in place) and :func:`merge_attention_states_n` (S states).

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
    _check_log2(_OP, log2)
    if out is None and lse_out is None:
        return torch.ops.ragattn.merge_attention_states(out_a, lse_a, out_b, lse_b, log2)
    if out is None:
        out = out_a.new_empty(out_a.shape)
    if lse_out is None:
        lse_out = lse_a.new_empty(lse_a.shape, dtype=torch.float32)
    torch.ops.ragattn.merge_attention_states.out(out_a, lse_a, out_b, lse_b, log2, out=out, lse_out=lse_out)
    return out, lse_out


def merge_attention_states_(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    log2: bool = False,
) -> None:
    """In-place :func:`merge_attention_states`: ``(out_a, lse_a)`` becomes the merge of a and b.

    Args:
        out_a: ``[N, num_heads, head_dim]`` fp16/bf16/fp32, any strides; overwritten with the merged out.
        lse_a: float32 ``[N, num_heads]``, any strides (a transposed ``[H, N]`` view too);
            overwritten with the merged lse (base 2 with ``log2``).
        out_b, lse_b: the other state, shapes and dtypes as ``out_a`` / ``lse_a``; must not share
            memory with ``out_a`` / ``lse_a`` (ValueError), nor ``out_a`` with ``lse_a``.
        log2: base-2 lses in and out (FlashInfer's convention), as in :func:`merge_attention_states`.

    The cascade step of an engine's accumulator: ``merge_attention_states_(acc, acc_lse, part,
    part_lse)`` per level. Same values as the functional op (same kernel, same rounding); the edge
    rule is the same too. Returns None.
    """
    _check_log2(_OP_, log2)
    torch.ops.ragattn.merge_attention_states_(out_a, lse_a, out_b, lse_b, log2)


def merge_attention_states_n(
    outs: Union[torch.Tensor, Sequence[torch.Tensor]],
    lses: Union[torch.Tensor, Sequence[torch.Tensor]],
    *,
    log2: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of S partial attentions of the same queries over disjoint key sets (a cascade of
    more than two levels in one pass: e.g. system prompt pages + shared chunk pages + private pages).

    Args:
        outs: ``[S, N, num_heads, head_dim]`` fp16/bf16/fp32 (any strides), or a list of S
            ``[N, num_heads, head_dim]`` tensors (stacked first: one copy).
        lses: float32 ``[S, N, num_heads]`` (any strides), or a list of S ``[N, num_heads]``;
            natural log, or base 2 with ``log2=True``.
        log2: base-2 lses in and out (FlashInfer's convention).

    Returns:
        out ``[N, num_heads, head_dim]`` in outs' dtype and lse float32 ``[N, num_heads]``:
        ``lse = logsumexp_s(lse_s)``, ``out = sum_s exp(lse_s - lse) out_s``, with the edge rule of
        :func:`merge_attention_states` per state (an empty state, lse ``-inf``/``+inf``, is never
        read; all empty: out 0, lse ``-inf``; a NaN lse poisons its (row, head)). S = 0 gives the
        all-empty result. Backends: Triton kernel (CUDA; CPU with ``RAGATTN_CPU_BACKEND=triton``),
        a C++ loop on CPU, the reference with ``RAGATTN_CPU_BACKEND=reference``.
    """
    _check_log2(_OPN, log2)
    outs = _stack_states("outs", outs, 3)
    lses = _stack_states("lses", lses, 2)
    return torch.ops.ragattn.merge_attention_states_n(outs, lses, log2)


def _run(out_a, lse_a, out_b, lse_b, out=None, lse_out=None, log2=False, op=_OP):
    _validate(out_a, lse_a, out_b, lse_b, out, lse_out, op=op)
    if lse_a.numel() == 0:  # no (row, head): nothing to read or write, whatever the strides
        return (out, lse_out) if out is not None else (out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape))
    chosen = backend.choose("merge_attention_states", out_a.device.type)
    if chosen == backend.TRITON:
        from ragattn.triton_kernels.merge_attention_states import merge_two_states

        # the kernel stores with a unit last-dim stride: anything else goes through a temporary
        out_k = out if out is not None and out.stride(-1) == 1 else None
        lse_k = lse_out if lse_out is not None and lse_out.stride(-1) == 1 else None
        with device_guard(out_a):
            o, lse = merge_two_states(out_a, lse_a, out_b, lse_b, out_k, lse_k, log2=log2)
    elif chosen == backend.REFERENCE:
        o, lse = _reference(out_a, lse_a, out_b, lse_b, log2)
    else:  # the C++ kernel (csrc/attention/merge_attention_states_cpu.cpp): one pass, any row/head strides
        out_a = out_a if out_a.stride(-1) == 1 else out_a.contiguous()
        out_b = out_b if out_b.stride(-1) == 1 else out_b.contiguous()
        o = out if out is not None and out.stride(-1) == 1 else out_a.new_empty(out_a.shape)
        lse = lse_out if lse_out is not None else lse_a.new_empty(lse_a.shape)
        torch.ops.ragattn._merge_attention_states_cpu(out_a, lse_a, out_b, lse_b, log2, out=o, lse_out=lse)
    if out is None:
        return o, lse
    if o is not out:
        out.copy_(o)
    if lse is not lse_out:
        lse_out.copy_(lse)
    return out, lse_out


def _run_n(outs, lses, log2=False):
    _validate_n(outs, lses)
    s, n, h, d = outs.shape
    chosen = backend.choose("merge_attention_states", outs.device.type)
    if chosen == backend.TRITON:
        from ragattn.triton_kernels.merge_attention_states import merge_n_states

        with device_guard(outs):
            return merge_n_states(outs, lses, log2=log2)
    if chosen == backend.REFERENCE:
        return _reference_n(outs, lses, log2)
    outs = outs if outs.stride(-1) == 1 else outs.contiguous()
    out = outs.new_empty((n, h, d))
    lse = lses.new_empty((n, h))
    torch.ops.ragattn._merge_attention_states_n_cpu(outs, lses, log2, out=out, lse_out=lse)
    return out, lse


def _run_inplace(out_a, lse_a, out_b, lse_b, log2=False):
    _run(out_a, lse_a, out_b, lse_b, out_a, lse_a, log2, op=_OP_)


def _run_functional(out_a, lse_a, out_b, lse_b, log2=False):
    return _run(out_a, lse_a, out_b, lse_b, log2=log2)


def _run_out(out_a, lse_a, out_b, lse_b, log2=False, *, out, lse_out):
    _run(out_a, lse_a, out_b, lse_b, out, lse_out, log2)


for _dev in ("CPU", "CUDA"):
    torch.library.impl("ragattn::merge_attention_states", _dev)(_run_functional)
    torch.library.impl("ragattn::merge_attention_states.out", _dev)(_run_out)
    torch.library.impl("ragattn::merge_attention_states_", _dev)(_run_inplace)
    torch.library.impl("ragattn::merge_attention_states_n", _dev)(_run_n)


@torch.library.register_fake("ragattn::merge_attention_states")
def _merge_fake(out_a, lse_a, out_b, lse_b, log2=False):
    _validate(out_a, lse_a, out_b, lse_b)
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape)  # contiguous, like the kernels


@torch.library.register_fake("ragattn::merge_attention_states.out")
def _merge_out_fake(out_a, lse_a, out_b, lse_b, log2=False, *, out, lse_out):
    _validate(out_a, lse_a, out_b, lse_b, out, lse_out)


@torch.library.register_fake("ragattn::merge_attention_states_")
def _merge_inplace_fake(out_a, lse_a, out_b, lse_b, log2=False):
    _validate(out_a, lse_a, out_b, lse_b, op=_OP_)


@torch.library.register_fake("ragattn::merge_attention_states_n")
def _merge_n_fake(outs, lses, log2=False):
    _validate_n(outs, lses)
    s, n, h, d = outs.shape
    return outs.new_empty((n, h, d)), lses.new_empty((n, h))
