"""Plain-torch reference of ``paged_attention`` (dense per sequence, float64-capable)."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


def gather_paged(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Slots ``0 .. length-1`` of one sequence: ``cache`` [num_pages, page_size, Hkv, D] -> [length, Hkv, D]."""
    page_size = cache.shape[1]
    slots = torch.arange(length, device=cache.device)
    pages = block_table_row.long()[slots // page_size]
    return cache[pages, slots % page_size]


def visible_slots(q_pos: torch.Tensor, length: int, window_left: int = -1) -> torch.Tensor:
    """bool ``[len(q_pos), length]``: slot ``j`` is visible to the row at ``q_pos[i]`` iff
    ``j <= q_pos[i]`` and (``window_left < 0`` or ``j >= q_pos[i] - window_left``)."""
    j = torch.arange(length, device=q_pos.device)[None, :]
    pos = q_pos.long()[:, None]
    visible = j <= pos
    if window_left >= 0:
        visible &= j >= pos - window_left
    return visible


def paged_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: Optional[float] = None,
    window_left: int = -1,
    *,
    compute_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Query row ``i`` of sequence ``b`` attends to slots ``j < kv_lens[b]`` with ``j <= q_pos[i]``
    and, when ``window_left >= 0``, ``j >= q_pos[i] - window_left``.

    q [total_q, H, D]; q_pos int32/int64 [total_q]; cu_seqlens_q int32/int64 [B + 1]; k_cache,
    v_cache [num_pages, page_size, Hkv, D] (any strides); block_table int32/int64 [B, max_pages];
    kv_lens int32/int64 [B].
    Returns out [total_q, H, D] in q's dtype and lse [total_q, H] (natural log; float32, or
    float64 for float64 inputs). A row with no visible key gets out 0 and lse -inf. Non-finite
    inputs follow the op's rule: only visible slots are read; a NaN or +inf visible score makes
    the (row, head) NaN (out and lse), a ``-inf`` one has weight 0 (a row whose visible scores
    are all ``-inf`` gets out 0 and lse ``-inf``, as in ``varlen_attention``); a non-finite
    visible ``v[j, d]`` makes ``out[i, d]`` NaN.

    ``compute_dtype`` (default: float64 for float64 inputs, else float32) is the dtype of every
    intermediate; the tests pass the input dtype to get the "same computation in low precision".
    """
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    cdt = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(total_q, num_heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.full((total_q, num_heads), float("-inf"), dtype=lse_dtype, device=q.device)
    cu = cu_seqlens_q.tolist()
    lens = kv_lens.tolist()
    head_to_kv = torch.arange(num_heads, device=q.device) // group
    for b in range(len(cu) - 1):
        q0, q1 = cu[b], cu[b + 1]
        L = lens[b]
        if q1 == q0 or L == 0:
            continue
        k = gather_paged(k_cache, block_table[b], L)[:, head_to_kv].to(cdt)  # [L, H, D]
        v = gather_paged(v_cache, block_table[b], L)[:, head_to_kv].to(cdt)
        qb = q[q0:q1].to(cdt)
        s = torch.einsum("ihd,jhd->hij", qb, k) * scale  # [H, nq, L]
        visible = visible_slots(q_pos[q0:q1], L, window_left)  # [nq, L]
        # a NaN or +inf visible score poisons its (row, head): out and lse NaN; -inf has weight 0
        bad_row = (visible[None] & (torch.isnan(s) | (s == float("inf")))).any(-1)  # [H, nq]
        s = s.masked_fill(~visible[None] | ~torch.isfinite(s), float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # [H, nq]; -inf where nothing is visible
        safe = torch.where(torch.isinf(row_lse), torch.zeros_like(row_lse), row_lse)
        p = torch.exp(s - safe[..., None])  # masked entries -> exp(-inf) = 0
        # a masked slot is never read into the sum (0 * NaN is NaN): a non-finite v[j, d] makes
        # out[i, d] NaN exactly for the rows i that see slot j, whatever their weight
        bad = ~torch.isfinite(v)
        o = torch.einsum("hij,jhd->ihd", p, v.masked_fill(bad, 0))
        if bool(bad.any()):
            hit = torch.einsum("ij,jhd->ihd", visible.to(cdt), bad.to(cdt)) > 0
            o = o.masked_fill(hit, float("nan"))
        o = o.masked_fill(bad_row.transpose(0, 1)[..., None], float("nan"))
        row_lse = row_lse.masked_fill(bad_row, float("nan"))
        out[q0:q1] = o.to(q.dtype)
        lse[q0:q1] = row_lse.transpose(0, 1).to(lse_dtype)
    return out, lse
