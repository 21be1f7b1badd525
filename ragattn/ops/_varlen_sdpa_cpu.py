"""``varlen_attention``'s CPU forward and backward for dense float32 calls (non-causal, no window or
blocks), where this beats the C++ kernels of ``csrc/attention/varlen_attention_cpu.cpp``: torch's fused CPU flash attention
(``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward, which return and take the
LSE) over the sequences padded into one batch, with the op's visible mask as an additive mask.

Block-Attention layouts (chunk blocks plus global rows, or REFRAG's independent chunks) are
split further: each chunk block's rows attend only to their own block's keys and the global
keys, so the chunks are batched as short sequences of their own (``_block_plan``), and only the
global query rows attend to the whole sequence. That does a fraction of the dense mask's work.

Semantics are the op's: a row that sees no key gets out 0 and lse -inf; masked keys are never
read. The fused kernel adds the mask to ``q . k`` and multiplies V by weights that are 0 where
masked, so a non-finite K/V of a masked key would leak (``NaN + -inf`` and ``0 * NaN`` are NaN):
a result with any non-finite value is recomputed by the reference (``has_nonfinite``; the
caller does it), which owns the non-finite rule. Finite inputs give finite results here, so the
reference only runs where a non-finite input is involved.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import torch

from ragattn.triton_kernels.plan_cache import IndexPlanCache

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def has_nonfinite(*ts: torch.Tensor) -> bool:
    """One cheap reduction per tensor instead of an elementwise test: a finite float32 sum means
    finite values (an overflowing sum only sends a finite result to the reference: still correct)."""
    for t in ts:
        if t.numel() and not math.isfinite(t.sum(dtype=torch.float32).item()):
            return True
    return False


class _Group:
    """One batch of padded (row list, key list) pairs for one fused call: rows ``q_idx [n, Lq]``
    and keys ``k_idx [n, Lk]`` (packed indices, padded with a real index), the additive mask
    ``[n, 1, Lq, Lk]`` (None: every row sees every key), ``q_ok [n, Lq]`` / ``k_ok [n, Lk]``
    (None: nothing padded), ``seen [n, Lq]`` (None: every real row sees a key), ``keep`` (the
    real rows that see a key; None: all), and ``q_span``/``k_span`` (start, end) when the batch is
    one contiguous run of packed rows/keys (read as a view, no gather)."""

    __slots__ = ("q_idx", "k_idx", "mask", "masks", "q_ok", "k_ok", "seen", "keep", "q_span", "k_span")

    def __init__(self, q_idx, k_idx, q_ok, k_ok, visible):
        self.q_idx, self.k_idx, self.q_ok, self.k_ok = q_idx, k_idx, q_ok, k_ok
        self.mask, self.seen, self.masks = None, None, {}
        if visible is not None:
            self.mask = torch.zeros(visible.shape, dtype=torch.float32).masked_fill_(~visible, float("-inf"))[:, None]
            seen = visible.any(-1)
            if q_ok is not None:
                seen |= ~q_ok  # padded rows are dropped anyway
            self.seen = None if bool(seen.all()) else seen
        if self.seen is None:
            self.keep = q_ok
        else:
            self.keep = self.seen if q_ok is None else self.seen & q_ok
        self.q_span = _span(q_idx, q_ok)
        self.k_span = _span(k_idx, k_ok)

    def mask_as(self, dtype):
        """The additive mask in the inputs' dtype (the fused kernel wants them equal), cached."""
        if self.mask is None or dtype == torch.float32:
            return self.mask
        if dtype not in self.masks:
            self.masks[dtype] = self.mask.to(dtype)
        return self.masks[dtype]


def _span(idx: torch.Tensor, ok: Optional[torch.Tensor]):
    """(start, end) when the padded indices are one contiguous run of packed rows (``idx`` is
    ``arange(start, end).view(n, L)``: read and written as views, no gather or scatter), else None."""
    if ok is not None or idx.numel() == 0:
        return None
    flat = idx.flatten()
    start, end = int(flat[0]), int(flat[-1]) + 1
    if end - start != flat.numel() or not bool((torch.diff(flat) == 1).all()):
        return None
    return start, end


def _stack_padded(lists: List[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``[n, width]`` packed indices from ``n`` index lists (each padded with its last entry, or 0
    when empty) and the validity mask (None when every list has the full width)."""
    lens = [t.numel() for t in lists]
    width = max(lens)
    if min(lens) == width:
        return torch.stack(lists), None
    idx = torch.stack([torch.nn.functional.pad(t, (0, width - t.numel()), value=int(t[-1]) if t.numel() else 0)
                       for t in lists])
    return idx, torch.arange(width)[None, :] < torch.tensor(lens)[:, None]


def _visible(qp, kp, qb, kb, q_ok, k_ok, causal, window_left):
    """bool ``[n, Lq, Lk]`` visible mask (the op's rule) of padded position/block batches, or None
    when everything is visible."""
    vis = None

    def both(a, b):
        return b if a is None else a & b

    if qb is not None:
        qb_, kb_ = qb[:, :, None], kb[:, None, :]
        vis = both(vis, (qb_ == kb_) | (qb_ == -1) | (kb_ == -1))
    qp_, kp_ = qp[:, :, None], kp[:, None, :]
    if causal:
        vis = both(vis, kp_ <= qp_)
    if window_left >= 0:
        vis = both(vis, kp_ >= qp_ - window_left)
    if q_ok is not None:
        vis = both(vis, q_ok[:, :, None])
    if k_ok is not None:
        vis = both(vis, k_ok[:, None, :])
    if vis is not None and bool(vis.all()):
        return None
    return vis


def _default_pos(cu: torch.Tensor, total: int) -> torch.Tensor:
    cu = cu.long()
    return torch.arange(total) - torch.repeat_interleave(cu[:-1], torch.diff(cu), output_size=total)


def plan(cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, causal, window_left, total_q, total_k) -> List[_Group]:
    """The fused calls of one op call, one per batch of padded (row list, key list) pairs: each
    sequence as one pair, except where the cost model (``_call_cost``) says that fewer
    (row, key) pairs in more calls are faster: a Block-Attention sequence is split into its global
    rows (over all its keys) and one pair per chunk block (its rows over its own keys and the
    global keys they may see). Every (row, key) pair the op may see lies in exactly one pair of
    lists. (Tiling a sliding-window sequence's rows, each tile over its own key range, does fewer
    pairs but was no faster: the fused kernel's time at these sizes follows its task count.)"""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    qpos = _default_pos(cu_q, total_q) if q_pos is None else q_pos.long()
    kpos = _default_pos(cu_k, total_k) if kv_pos is None else kv_pos.long()
    blocks = q_block is not None or kv_block is not None
    qb_all = (q_block.long() if q_block is not None else torch.full((total_q,), -1)) if blocks else None
    kb_all = (kv_block.long() if kv_block is not None else torch.full((total_k,), -1)) if blocks else None
    dense, split = ([], []), ([], [])  # (row lists, key lists) of the two batches
    for b in range(len(cq) - 1):
        qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if qe == qs or ke == ks:  # no rows, or rows that see nothing (out 0, lse -inf)
            continue
        qp, kp = qpos[qs:qe], kpos[ks:ke]
        if blocks and _split_block_sequence(qb_all[qs:qe], kb_all[ks:ke], qp, kp, qs, ks, causal, window_left, dense,
                                            split):
            continue
        dense[0].append(torch.arange(qs, qe))
        dense[1].append(torch.arange(ks, ke))
    groups = []
    for q_lists, k_lists in (dense, split):
        if not q_lists:
            continue
        q_idx, q_ok = _stack_padded(q_lists)
        k_idx, k_ok = _stack_padded(k_lists)
        if k_idx.shape[1] == 0:  # no list has a key: these rows see nothing
            continue
        qb = kb = None
        if blocks:
            qb, kb = qb_all[q_idx], kb_all[k_idx]
        vis = _visible(qpos[q_idx], kpos[k_idx], qb, kb, q_ok, k_ok, causal, window_left)
        groups.append(_Group(q_idx, k_idx, q_ok, k_ok, vis))
    return groups


# Cost of one fused CPU flash attention call, per head, in microseconds: the kernel runs one task
# per (batch entry, head, block of query rows) at ~2.7 us each plus ~3.7 ns per padded
# (row, key) pair; one more call costs ~10 us of Python, folding and scatter (~2.5 us per head at
# 4 heads). Fit on this project's 2-core CPU machine (torch 2.13, fp32, head_dim 64, one thread):
# 1x86x86 rows x keys 140 us, 4x20x26 73 us, 1x6x86 20 us, 1x166x166 460 us at 4 heads.
_TASK_US, _PAIR_US, _CALL_US = 2.7, 0.0037, 2.5


def _call_cost(n: int, rows: int, keys: int) -> float:
    """Modelled time of one fused call over ``n`` padded lists of ``rows`` rows and ``keys`` keys."""
    q_split = 256 if rows >= 768 else 64 if rows >= 192 else 32  # the kernel's query block
    return n * (_TASK_US * -(-rows // q_split) + _PAIR_US * rows * keys)


def _seen_keys(rows_pos, kp, causal, window_left) -> torch.Tensor:
    """bool over keys: a key some row at positions ``rows_pos`` may see by position (causal, window)."""
    keys = torch.ones(kp.shape, dtype=torch.bool)
    if causal:
        keys &= kp <= rows_pos.max()
    if window_left >= 0:
        keys &= kp >= rows_pos.min() - window_left
    return keys


def _split_block_sequence(qb, kb, qp, kp, qs, ks, causal, window_left, dense, split) -> bool:
    """Append a block sequence's global rows (over all keys) to the ``dense`` lists and each chunk
    block's rows (over its own keys and the global ones they may see) to the ``split`` lists, if
    the cost model says that is faster than one dense pair; return whether it did."""
    ids, counts = torch.unique(qb, return_counts=True)
    chunk = ids >= 0
    if int(chunk.sum()) < 2:
        return False
    glob = kb == -1
    rows, keys = [], []
    for c in ids[chunk].tolist():
        r = (qb == c).nonzero().flatten()
        rows.append(r + qs)
        keys.append((((kb == c) | glob) & _seen_keys(qp[r], kp, causal, window_left)).nonzero().flatten() + ks)
    n_glob_rows = int(counts[~chunk].sum())
    split_cost = _call_cost(len(rows), max(r.numel() for r in rows), max(k.numel() for k in keys))
    if n_glob_rows:
        split_cost += _call_cost(1, n_glob_rows, kb.numel()) + _CALL_US
    if split_cost >= _call_cost(1, qb.numel(), kb.numel()):
        return False
    if n_glob_rows:
        dense[0].append((qb == -1).nonzero().flatten() + qs)
        dense[1].append(torch.arange(ks, ks + kb.numel()))
    split[0].extend(rows)
    split[1].extend(keys)
    return True


def _fold(x: torch.Tensor, idx: torch.Tensor, span) -> torch.Tensor:
    """packed ``[T, H, (D)]`` -> ``[n, H, L, (D)]`` at the padded indices ``idx [n, L]`` (a view for a span)."""
    if span is not None:  # one as_strided instead of slice + view + transpose (this runs on every call)
        n, rows = idx.shape
        st, sh = x.stride()[:2]
        return x.as_strided((n, x.shape[1], rows) + tuple(x.shape[2:]), (rows * st, sh, st) + tuple(x.stride()[2:]),
                            x.storage_offset() + span[0] * st)
    return x[idx].transpose(1, 2)


def forward(q, k, v, groups: List[_Group], scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    total_q, num_heads, head_dim = q.shape
    in_order = _row_order(groups, total_q)
    if in_order is not None:  # the groups' outputs, concatenated, are the packed rows: no scatter
        res = [_run(q, k, v, g, scale) for g in in_order]
        if len(res) == 1:
            o, lse = res[0]
            return o.transpose(1, 2).reshape(q.shape), lse.transpose(1, 2).reshape(total_q, num_heads)
        return (torch.cat([o.transpose(1, 2).reshape(-1, num_heads, head_dim) for o, _ in res]),
                torch.cat([lse.transpose(1, 2).reshape(-1, num_heads) for _, lse in res]))
    out = q.new_zeros(q.shape)
    lse_out = torch.full((total_q, num_heads), float("-inf"), dtype=torch.float32)
    for g in groups:
        o, lse = _run(q, k, v, g, scale)
        o, lse = o.transpose(1, 2), lse.transpose(1, 2)  # [n, L, H, (D)]
        if g.keep is None and g.q_span is not None:
            out[g.q_span[0]: g.q_span[1]].view(o.shape).copy_(o)
            lse_out[g.q_span[0]: g.q_span[1]].view(lse.shape).copy_(lse)
        elif g.keep is None:
            out[g.q_idx.flatten()] = o.flatten(0, 1)
            lse_out[g.q_idx.flatten()] = lse.flatten(0, 1).float()
        else:
            out[g.q_idx[g.keep]] = o[g.keep]
            lse_out[g.q_idx[g.keep]] = lse[g.keep].float()
    return out, lse_out


def _row_order(groups: List[_Group], total_q: int) -> Optional[List[_Group]]:
    """The groups sorted by their query rows when those are contiguous runs that tile
    ``[0, total_q)`` and every row sees a key (e.g. Block-Attention's chunks, then its global
    tail); else None."""
    if any(g.keep is not None or g.q_span is None for g in groups):
        return None
    ordered = sorted(groups, key=lambda g: g.q_span[0])
    end = 0
    for g in ordered:
        if g.q_span[0] != end:
            return None
        end = g.q_span[1]
    return ordered if end == total_q else None


def _run(q, k, v, g: _Group, scale):
    return _FLASH(_fold(q, g.q_idx, g.q_span), _fold(k, g.k_idx, g.k_span), _fold(v, g.k_idx, g.k_span),
                  attn_mask=g.mask_as(q.dtype), scale=scale)


def backward(dout, q, k, v, out, lse, groups: List[_Group], scale: float):
    """dq, dk, dv of the op from its saved out and lse (the fused CPU backward per group)."""
    grads = []
    for g in groups:
        qf, kf, vf = _fold(q, g.q_idx, g.q_span), _fold(k, g.k_idx, g.k_span), _fold(v, g.k_idx, g.k_span)
        of, df, lf = _fold(out, g.q_idx, g.q_span), _fold(dout, g.q_idx, g.q_span), _fold(lse, g.q_idx, g.q_span)
        if g.keep is not None:
            # rows that see no key and padded rows: no gradient; lse +inf makes every weight
            # exp(s - lse) of the row 0 (its own -inf would give exp(-inf + inf) = NaN)
            df = df.masked_fill(~g.keep[:, None, :, None], 0)
            lf = lf.masked_fill(~g.keep[:, None, :], float("inf"))
        gq, gk, gv = _FLASH_BWD(df.contiguous(), qf, kf, vf, of, lf.float().contiguous(), 0.0, False,
                                attn_mask=g.mask_as(q.dtype), scale=scale)
        grads.append((g, gq.transpose(1, 2), gk.transpose(1, 2), gv.transpose(1, 2)))  # [n, L, H, D]
    in_order = _row_order(groups, q.shape[0])
    if in_order is not None:  # every query row lies in exactly one group: concatenate
        by_group = {id(g): gq for g, gq, _, _ in grads}
        dq = torch.cat([by_group[id(g)].reshape(-1, *q.shape[1:]) for g in in_order])
    else:
        dq = torch.zeros_like(q)
        for g, gq, _, _ in grads:
            if g.q_span is not None:
                dq[g.q_span[0]: g.q_span[1]].view(gq.shape).copy_(gq)
            elif g.q_ok is None:
                dq.index_add_(0, g.q_idx.flatten(), gq.flatten(0, 1).to(dq.dtype))
            else:
                dq.index_add_(0, g.q_idx[g.q_ok], gq[g.q_ok].to(dq.dtype))
    # keys may appear in several groups (global keys): accumulate, onto a group's own dk/dv where
    # one group has every key (Block-Attention's global rows) instead of onto zeros
    base = next((i for i, (g, *_) in enumerate(grads) if g.k_span == (0, k.shape[0]) and g.k_idx.shape[0] == 1), None)
    if base is None:
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    else:
        dk, dv = grads[base][2].reshape(k.shape), grads[base][3].reshape(v.shape)
    for i, (g, _, gk, gv) in enumerate(grads):
        if i == base:
            continue
        if g.k_span is not None:
            dk[g.k_span[0]: g.k_span[1]].view(gk.shape).add_(gk)
            dv[g.k_span[0]: g.k_span[1]].view(gv.shape).add_(gv)
        elif g.k_ok is None:
            dk.index_add_(0, g.k_idx.flatten(), gk.flatten(0, 1).to(dk.dtype))
            dv.index_add_(0, g.k_idx.flatten(), gv.flatten(0, 1).to(dv.dtype))
        else:
            dk.index_add_(0, g.k_idx[g.k_ok], gk[g.k_ok].to(dk.dtype))
            dv.index_add_(0, g.k_idx[g.k_ok], gv[g.k_ok].to(dv.dtype))
    return dq, dk, dv


def default_scale(head_dim: int, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


# A model calls the op once per layer with the same index tensors: keep the last few plans (hits:
# the same tensor objects at the same versions, or equal contents, see ragattn.triton_kernels.plan_cache).
_PLAN_CACHE = IndexPlanCache(8)


def cached_plan(cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, causal, window_left, total_q, total_k,
                check: Optional[Callable[[], None]] = None):
    """``plan``, cached; ``check`` (the op's checks of the index values) runs before a plan is
    built, so every plan in the cache was built from index values that passed it."""
    index = (cu_q, cu_k, q_pos, kv_pos, q_block, kv_block)

    def build():
        if check is not None:
            check()
        return plan(*index, causal, window_left, total_q, total_k)

    return _PLAN_CACHE.get(index, (bool(causal), int(window_left), total_q, total_k), build)


def run_forward(q, k, v, cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, causal, scale, window_left, check=None):
    """The op's forward on this path (the caller checks ``has_nonfinite``); ``check`` as in ``cached_plan``."""
    groups = cached_plan(cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, causal, window_left, q.shape[0], k.shape[0],
                         check)
    return forward(q, k, v, groups, default_scale(q.shape[-1], scale))


def run_backward(dout, q, k, v, out, lse, cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, causal, scale, window_left,
                 check=None):
    """The op's backward on this path (the caller checks ``has_nonfinite``); ``check`` as in ``cached_plan``."""
    groups = cached_plan(cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, causal, window_left, q.shape[0], k.shape[0],
                         check)
    return backward(dout, q, k, v, out, lse, groups, default_scale(q.shape[-1], scale))
