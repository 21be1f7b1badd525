"""Merging partial attention states (out, lse) computed over disjoint key sets.

Two kernels share one per-row rule (the reference implements the same one):

* ``lse = -inf`` (or ``+inf``, FlashAttention's marker for a row that saw no key) means the side saw
  no key: weight 0, its ``out`` is never read; every side empty gives out 0, lse ``-inf``.
* otherwise, with ``lse = logaddexp`` over the sides, ``out = sum_s exp(lse_s - lse) * out_s``;
  a side that is read contributes its values even when its weight underflows to 0, so a
  non-finite value in it makes that output element NaN (never a finite number).
* an ``lse`` of NaN makes the merged row (that head) NaN: out and lse.

* ``merge_two_states``: the public ``merge_attention_states`` op (cascade attention), also in place.
* ``merge_n_states``: its N-way form ``merge_attention_states_n`` (S states of any dtype/strides).
* ``merge_split_states``: the reduction of split-KV ``paged_attention`` (S partial states per row).

``LOG2`` (constexpr): the lses are base 2 (FlashInfer's convention); they are taken to natural log
on load (``* ln 2``) and the merged lse is written back in base 2 (``* log2 e``).

One program handles one row (query token) over all its heads: ``[heads, head_dim]`` vector loads,
memory-bound. Row offsets are computed in int64 (row * stride can pass 2^31 elements).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _side_weight(ls, m_safe):
    """Weight of a side with log-sum-exp ``ls`` against the row's shift ``m_safe`` and whether it is read."""
    read = ls > float("-inf")  # False for -inf (empty) and NaN (handled by the caller)
    w = tl.where(read, tl.exp(ls - m_safe), 0.0)
    return w, read


@triton.jit
def _finish(o, total, m_safe, bad):
    """Normalise; NaN for non-finite elements and for rows with a NaN lse; -inf lse for empty rows."""
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    o = o * inv[:, None]
    finite = (o == o) & (tl.abs(o) < float("inf"))
    o = tl.where(finite & (bad == 0)[:, None], o, float("nan"))
    lse = tl.where(total > 0, m_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    lse = tl.where(bad == 0, lse, float("nan"))
    return o, lse


@triton.jit
def _load_lse(ptr, mask):
    ls = tl.load(ptr, mask=mask, other=float("-inf"))
    return tl.where(ls == float("inf"), float("-inf"), ls)  # FlashAttention: +inf = saw no key


@triton.jit
def _store_merged(out, lse, row, h, d, h_ok, d_ok, o, ls, stride_ot, stride_oh, stride_lot, stride_loh,
                  LOG2: tl.constexpr):
    """One row's merged out (in out's dtype) and lse (base 2 again with LOG2), shared by the merges."""
    if LOG2:
        ls = ls * 1.4426950408889634
    tl.store(out + row * stride_ot + h[:, None] * stride_oh + d[None, :], o.to(out.dtype.element_ty),
             mask=h_ok[:, None] & d_ok[None, :])
    tl.store(lse + row * stride_lot + h * stride_loh, ls, mask=h_ok)


@triton.jit
def _natural(ls, LOG2: tl.constexpr):
    if LOG2:
        ls = ls * 0.6931471805599453
    return ls


@triton.jit
def _merge_two_kernel(
    out_a, lse_a, out_b, lse_b, out, lse,
    stride_at, stride_ah, stride_bt, stride_bh, stride_ot, stride_oh,
    stride_lat, stride_lah, stride_lbt, stride_lbh, stride_lot, stride_loh,
    num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, LOG2: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < num_heads
    d_ok = d < head_dim
    la = _natural(_load_lse(lse_a + row * stride_lat + h * stride_lah, h_ok), LOG2)
    lb = _natural(_load_lse(lse_b + row * stride_lbt + h * stride_lbh, h_ok), LOG2)
    bad = ((la != la) | (lb != lb)).to(tl.int32)
    m = tl.maximum(tl.where(la == la, la, float("-inf")), tl.where(lb == lb, lb, float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa, read_a = _side_weight(la, m_safe)
    wb, read_b = _side_weight(lb, m_safe)
    # a side that saw no key is not loaded at all (its out may be garbage)
    oa = tl.load(out_a + row * stride_at + h[:, None] * stride_ah + d[None, :],
                 mask=read_a[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    ob = tl.load(out_b + row * stride_bt + h[:, None] * stride_bh + d[None, :],
                 mask=read_b[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    o, ls = _finish(oa * wa[:, None] + ob * wb[:, None], wa + wb, m_safe, bad)
    _store_merged(out, lse, row, h, d, h_ok, d_ok, o, ls, stride_ot, stride_oh, stride_lot, stride_loh, LOG2)


@triton.jit
def _merge_n_kernel(
    outs, lses, out, lse,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_lh,
    stride_ot, stride_oh, stride_lot, stride_loh,
    num_states, num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, LOG2: tl.constexpr = False,
):
    # Two passes over the S states: their max lse (and NaN flag), then the weighted sum; the
    # states are never all resident, so S is unbounded.
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < num_heads
    d_ok = d < head_dim
    lse_ptr = lses + row * stride_lt + h * stride_lh
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    bad = tl.zeros([BLOCK_H], tl.int32)
    for _ in range(0, num_states):
        ls = _natural(_load_lse(lse_ptr, h_ok), LOG2)
        bad = bad | (ls != ls).to(tl.int32)
        m = tl.maximum(m, tl.where(ls == ls, ls, float("-inf")))
        lse_ptr += stride_ls
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    lse_ptr = lses + row * stride_lt + h * stride_lh
    out_ptr = outs + row * stride_pt + h[:, None] * stride_ph + d[None, :]
    for _ in range(0, num_states):
        w, read = _side_weight(_natural(_load_lse(lse_ptr, h_ok), LOG2), m_safe)
        o = tl.load(out_ptr, mask=read[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc += o * w[:, None]
        total += w
        lse_ptr += stride_ls
        out_ptr += stride_ps
    o, ls = _finish(acc, total, m_safe, bad)
    _store_merged(out, lse, row, h, d, h_ok, d_ok, o, ls, stride_ot, stride_oh, stride_lot, stride_loh, LOG2)


@triton.jit
def _merge_split_kernel(
    parts_out, parts_lse, out, lse,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    stride_ot, stride_oh, stride_lot,
    num_splits, num_heads, head_dim,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < num_heads
    d_ok = d < head_dim
    ls_all = _load_lse(parts_lse + s[:, None].to(tl.int64) * stride_ls + row * stride_lt + h[None, :],
                       (s[:, None] < num_splits) & h_ok[None, :])  # [S, H]
    bad = tl.max((ls_all != ls_all).to(tl.int32), 0)
    m = tl.max(tl.where(ls_all == ls_all, ls_all, float("-inf")), 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    lse_ptr = parts_lse + row * stride_lt + h
    out_ptr = parts_out + row * stride_pt + h[:, None] * stride_ph + d[None, :]
    for _ in range(0, num_splits):  # pointers step by a split (64-bit pointer arithmetic)
        w, read = _side_weight(_load_lse(lse_ptr, h_ok), m_safe)
        o = tl.load(out_ptr, mask=read[:, None] & d_ok[None, :], other=0.0)
        acc += o * w[:, None]
        total += w
        lse_ptr += stride_ls
        out_ptr += stride_ps
    o, ls = _finish(acc, total, m_safe, bad)
    tl.store(out + row * stride_ot + h[:, None] * stride_oh + d[None, :], o.to(out.dtype.element_ty),
             mask=h_ok[:, None] & d_ok[None, :])
    tl.store(lse + row * stride_lot + h, ls, mask=h_ok)


def _num_warps(block_h: int, block_d: int) -> int:
    return 8 if block_h * block_d >= 8192 else 4


def merge_two_states(out_a, lse_a, out_b, lse_b, out=None, lse=None, log2=False):
    """out_a, out_b [N, H, D] (any strides, last dim made unit); lse_a, lse_b float32 [N, H] (any
    strides) -> (out [N, H, D], lse [N, H]), written into ``out``/``lse`` when given (last dim unit
    stride; ``out``/``lse`` may be ``out_a``/``lse_a`` themselves: each element is read before it is
    written by the same program). ``log2``: base-2 lses in and out."""
    n, h, d = out_a.shape
    out_a = out_a if out_a.stride(-1) == 1 else out_a.contiguous()
    out_b = out_b if out_b.stride(-1) == 1 else out_b.contiguous()
    out = torch.empty(out_a.shape, dtype=out_a.dtype, device=out_a.device) if out is None else out
    lse = torch.empty(lse_a.shape, dtype=torch.float32, device=lse_a.device) if lse is None else lse
    if n == 0 or h == 0:
        return out, lse
    block_h, block_d = triton.next_power_of_2(h), triton.next_power_of_2(d)
    _merge_two_kernel[(n,)](
        out_a, lse_a, out_b, lse_b, out, lse,
        out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1), out.stride(0), out.stride(1),
        lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1), lse.stride(0), lse.stride(1),
        h, d,
        BLOCK_H=block_h, BLOCK_D=block_d, LOG2=bool(log2), num_warps=_num_warps(block_h, block_d),
    )
    return out, lse


def merge_n_states(outs, lses, out=None, lse=None, log2=False):
    """outs [S, N, H, D] (any strides, last dim made unit), lses float32 [S, N, H] (any strides) ->
    (out [N, H, D], lse [N, H]) written into ``out``/``lse`` when given (unit last-dim stride).
    ``log2``: base-2 lses in and out."""
    s, n, h, d = outs.shape
    outs = outs if outs.stride(-1) == 1 else outs.contiguous()
    out = torch.empty((n, h, d), dtype=outs.dtype, device=outs.device) if out is None else out
    lse = torch.empty((n, h), dtype=torch.float32, device=outs.device) if lse is None else lse
    if n == 0 or h == 0:
        return out, lse
    block_h, block_d = triton.next_power_of_2(h), triton.next_power_of_2(d)
    _merge_n_kernel[(n,)](
        outs, lses, out, lse,
        outs.stride(0), outs.stride(1), outs.stride(2), lses.stride(0), lses.stride(1), lses.stride(2),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        s, h, d,
        BLOCK_H=block_h, BLOCK_D=block_d, LOG2=bool(log2), num_warps=_num_warps(block_h, block_d),
    )
    return out, lse


def merge_split_states(parts_out: torch.Tensor, parts_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Reduce S partial states: parts_out float32 [S, N, H, D], parts_lse float32 [S, N, H] (contiguous)
    into out [N, H, D], lse [N, H] (unit stride in the last dim)."""
    s, n, h, d = parts_out.shape
    if n == 0 or h == 0:
        return
    block_h, block_d = triton.next_power_of_2(h), triton.next_power_of_2(d)
    _merge_split_kernel[(n,)](
        parts_out, parts_lse, out, lse,
        parts_out.stride(0), parts_out.stride(1), parts_out.stride(2), parts_lse.stride(0), parts_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        s, h, d,
        BLOCK_S=max(2, triton.next_power_of_2(s)), BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=_num_warps(block_h, block_d),
    )
