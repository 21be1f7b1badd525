"""Merging partial attention states (out, lse) computed over disjoint key sets.

Two kernels share one per-row rule: with ``lse = logaddexp(lse_a, lse_b)`` the merged output is
``exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b``; a side with ``lse = -inf`` has weight 0
and its ``out`` is never read, and both ``-inf`` gives out 0, lse -inf.

* ``merge_two_states``: the public ``merge_attention_states`` op (cascade attention).
* ``merge_split_states``: the reduction of split-KV ``paged_attention`` (S partial states per row).

One program handles one (row, head) pair: the work is a handful of vector loads, memory-bound.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _merge_two_kernel(
    out_a, lse_a, out_b, lse_b, out, lse,
    stride_at, stride_ah, stride_bt, stride_bh, stride_ot, stride_oh,
    stride_lat, stride_lbt, stride_lot,
    num_heads, head_dim,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    la = tl.load(lse_a + row * stride_lat + head)
    lb = tl.load(lse_b + row * stride_lbt + head)
    m = tl.maximum(la, lb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m_safe)  # 0 when la = -inf
    wb = tl.exp(lb - m_safe)
    total = wa + wb
    # a side with weight 0 is not loaded at all (its out may be garbage)
    len_a = tl.where(wa > 0, head_dim, 0)
    len_b = tl.where(wb > 0, head_dim, 0)
    oa = tl.load(out_a + row * stride_at + head * stride_ah + d, mask=d < len_a, other=0.0).to(tl.float32)
    ob = tl.load(out_b + row * stride_bt + head * stride_bh + d, mask=d < len_b, other=0.0).to(tl.float32)
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    o = (oa * wa + ob * wb) * inv
    tl.store(out + row * stride_ot + head * stride_oh + d, o.to(out.dtype.element_ty), mask=dmask)
    tl.store(lse + row * stride_lot + head, tl.where(total > 0, m_safe + tl.log(total), float("-inf")))


@triton.jit
def _merge_split_kernel(
    parts_out, parts_lse, out, lse,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    stride_ot, stride_oh, stride_lot,
    num_splits, head_dim,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < num_splits
    ls = tl.load(parts_lse + s * stride_ls + row * stride_lt + head, mask=smask, other=float("-inf"))
    m = tl.max(ls, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(ls - m_safe)  # [S]
    total = tl.sum(w, 0)
    o_ptrs = parts_out + s[:, None] * stride_ps + row * stride_pt + head * stride_ph + d[None, :]
    o = tl.load(o_ptrs, mask=(w[:, None] > 0) & (d[None, :] < head_dim), other=0.0)
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    acc = tl.sum(o * w[:, None], 0) * inv
    tl.store(out + row * stride_ot + head * stride_oh + d, acc.to(out.dtype.element_ty), mask=d < head_dim)
    tl.store(lse + row * stride_lot + head, tl.where(total > 0, m_safe + tl.log(total), float("-inf")))


def merge_two_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """out_a, out_b [N, H, D] (last dim contiguous); lse_a, lse_b float32 [N, H] -> (out [N, H, D], lse [N, H])."""
    n, h, d = out_a.shape
    out_a, out_b = out_a.contiguous(), out_b.contiguous()
    lse_a, lse_b = lse_a.contiguous(), lse_b.contiguous()
    out = torch.empty_like(out_a)
    lse = torch.empty_like(lse_a)
    if n == 0 or h == 0:
        return out, lse
    _merge_two_kernel[(n, h)](
        out_a, lse_a, out_b, lse_b, out, lse,
        out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1), out.stride(0), out.stride(1),
        lse_a.stride(0), lse_b.stride(0), lse.stride(0),
        h, d,
        BLOCK_D=triton.next_power_of_2(d),
    )
    return out, lse


def merge_split_states(parts_out: torch.Tensor, parts_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Reduce S partial states: parts_out float32 [S, N, H, D], parts_lse float32 [S, N, H] into out [N, H, D], lse [N, H]."""
    s, n, h, d = parts_out.shape
    if n == 0 or h == 0:
        return
    _merge_split_kernel[(n, h)](
        parts_out, parts_lse, out, lse,
        parts_out.stride(0), parts_out.stride(1), parts_out.stride(2), parts_lse.stride(0), parts_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        s, d,
        BLOCK_S=max(2, triton.next_power_of_2(s)), BLOCK_D=triton.next_power_of_2(d),
    )
