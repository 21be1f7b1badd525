"""The copy path's CPU route through torch's SDPA: a request's slots read in place as rows.

A :class:`ragattn.kv.PagedKV` allocates each sequence's pages consecutively, so on the CPU a
sequence's slots are one run of rows of a ``[1, Hkv, num_pages * page_size, D]`` view of a layer
(no copy), and SDPA over that run (with a mask where a row may not see every slot) computes what
``paged_attention`` computes, by the same rule: slot ``j`` is visible to a query at position
``p`` iff ``j <= p``, ``j < kv_lens`` (and ``j >= p - window_left``). Which steps take it is
:func:`ragattn.ops.backend.cpu_sdpa_enabled` (``RAGATTN_HF_CPU_SDPA``, read when a forward is
planned), the ops' one backend chooser.

    head_rows(pages); row_masks(spans, positions, q, window_left, dtype); rows_sdpa(query, k4, v4, plan, scaling)
"""
from __future__ import annotations

import torch

def head_rows(pages: torch.Tensor):
    """``pages`` ``[num_pages, page_size, Hkv, D]`` as ``[1, Hkv, num_pages * page_size, D]`` (no
    copy), or None when its slots do not merge into one row stride. One ``as_strided`` for
    contiguous pages (a request cache is built per request, and its 2 x layers views are made in
    its first forward, where every Python op costs several microseconds)."""
    n, p, h, d = pages.shape
    if pages.is_contiguous():
        return pages.as_strided((1, h, n * p, d), (h * d, d, h * d, 1))
    try:
        return pages.view(-1, h, d).permute(1, 0, 2)[None]
    except RuntimeError:
        return None


def row_masks(spans, positions: torch.Tensor, q: int, window_left: int, dtype: torch.dtype) -> list:
    """Per sequence ``(first row, kv length, additive mask [q, length] in dtype (0 visible, -inf
    not) or None)`` for ``spans`` ``[(first row, kv length)]`` and the query rows' ``positions``
    ``[B * q]``. Every query sees at least its own slot, so no mask row is all -inf. The mask is
    additive because SDPA turns a boolean one into exactly that on every call."""
    plan = []
    for i, (start, length) in enumerate(spans):
        qp = positions[i * q:(i + 1) * q]
        mask = None
        windowed = 0 <= window_left < length - 1
        if windowed or not (q == 1 and int(qp[0]) >= length - 1):
            j = torch.arange(length)[None, :]
            mask = j <= qp[:, None].long()
            if windowed:
                mask &= j >= qp[:, None].long() - window_left
            mask = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
        plan.append((start, length, mask))
    return plan


def rows_sdpa(query, k4, v4, rows_plan, scaling):
    """Per sequence ``(start, length, mask | None)``: SDPA of its queries (``query`` ``[B, Hq, q,
    D]``) over its slots ``k4[:, :, start:start + length]`` (``k4``, ``v4``: ``[1, Hkv, rows, D]``
    views of the pages), GQA without repeating K/V. Returns ``[B, q, Hq, D]`` (for one row, a
    transposed view of SDPA's result)."""
    b, hq, q, d = query.shape
    gqa = hq != k4.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if b == 1 and q == 1 and rows_plan[0][2] is None and rows_plan[0][1] > 0:
        # decode, every slot visible (the common case): no mask, no output buffer to fill, SDPA's
        # [1, Hq, 1, D] viewed as the [1, 1, Hq, D] result
        start, length, _ = rows_plan[0]
        o = sdpa(query, k4.narrow(2, start, length), v4.narrow(2, start, length), scale=scaling,
                 enable_gqa=gqa)
        return o.view(1, 1, hq, d)
    if b == 1 and rows_plan[0][1] > 0:   # one row (a final block's prefill): SDPA's result as a view
        start, length, mask = rows_plan[0]
        return sdpa(query, k4.narrow(2, start, length), v4.narrow(2, start, length), attn_mask=mask,
                    scale=scaling, enable_gqa=gqa).transpose(1, 2)
    out = query.new_zeros(b, q, hq, d)
    for i, (start, length, mask) in enumerate(rows_plan):
        if length == 0:
            continue
        o = sdpa(query[i:i + 1], k4.narrow(2, start, length), v4.narrow(2, start, length),
                 attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out[i] = o[0].transpose(0, 1)
    return out
