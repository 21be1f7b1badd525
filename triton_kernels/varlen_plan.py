"""The host planner of ``varlen_attention``'s Triton kernels: which key tiles each query tile can
see, as work items (plain torch on the inputs' device; syncs with the host, built once per index
tensors and cached by the launcher).

Each query and key tile is summarised by five numbers (min/max position, min/max non-global block
id, "has a global token"); a tile pair is visible in full, in part or not at all from those alone
(``tile_pairs``), so the mask is never materialised. Per query tile the visible key tiles form a
CSR, the ones visible in full first (the kernels' mask-free loop) then the partially visible ones
(the masked loop); a query tile that sees many key tiles (a global question block) is split over
several work items whose partial (out, lse) the launcher merges. Items are sorted longest first.
The backward's dk/dv kernel reads the same pairs by key tile (``VarlenPlan.by_k``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

_INT_MAX = 2**31 - 1
_INT_MIN = -(2**31)
_META = 5  # min_pos, max_pos, min_block (non-global), max_block (non-global), has_global
_WORK = 8  # a work item: row start, row end (sequence), other side's end, e_start, e_mid, e_end, dest, 0
_PAIR_CHUNK = 1 << 22  # tile pairs examined at once while planning (bounds the plan's memory)
MIN_SPLIT = 16  # key tiles per split at least: a split costs a partial write and a merge


def tile_metadata(cu: torch.Tensor, pos: torch.Tensor, blk: torch.Tensor, total: int, block: int):
    """Split each sequence of ``cu`` into tiles of ``block`` rows and summarise each tile.

    Returns ``tile_off`` int64 ``[B + 1]`` (sequence ``b`` owns tiles ``tile_off[b]:tile_off[b+1]``),
    ``tile_seq`` int64 ``[T]``, ``tile_start`` int64 ``[T]`` (first row) and ``meta`` int64 ``[T, 5]``:
    min/max position, min/max non-global block id (INT_MAX/INT_MIN if none) and "has a global
    token" (0/1). ``T`` is the exact tile count (one host sync).
    """
    dev = cu.device
    cu64 = cu.long()
    ntiles = (cu64[1:] - cu64[:-1] + block - 1) // block
    tile_off = torch.cat([ntiles.new_zeros(1), torch.cumsum(ntiles, 0)])
    num_tiles = int(tile_off[-1])
    t = torch.arange(num_tiles, device=dev)
    tile_seq = torch.searchsorted(tile_off[1:], t, right=True)
    tile_start = cu64[tile_seq] + (t - tile_off[tile_seq]) * block

    tok = torch.arange(total, device=dev)
    tok_seq = torch.searchsorted(cu64[1:], tok, right=True)
    tok_tile = tile_off[tok_seq] + (tok - cu64[tok_seq]) // block
    glob = blk == -1
    meta = torch.empty(num_tiles, _META, dtype=torch.long, device=dev)
    fill = (_INT_MAX, _INT_MIN, _INT_MAX, _INT_MIN, 0)
    vals = (
        (pos, "amin"),
        (pos, "amax"),
        (torch.where(glob, _INT_MAX, blk), "amin"),
        (torch.where(glob, _INT_MIN, blk), "amax"),
        (glob.long(), "amax"),
    )
    for i, ((src, how), f) in enumerate(zip(vals, fill)):
        col = torch.full((num_tiles,), f, dtype=torch.long, device=dev)
        meta[:, i] = col.scatter_reduce(0, tok_tile, src.long(), how, include_self=True)
    return tile_off, tile_seq, tile_start, meta


def tile_pairs(q_meta, k_meta, q_tiles, k_tiles, causal: bool, window_left: int):
    """(any visible, all visible) bool for tile pairs ``q_tiles[i]``, ``k_tiles[i]`` from their metadata."""
    q_min, q_max, q_bmin, q_bmax, q_glob = q_meta[q_tiles].unbind(1)
    k_min, k_max, k_bmin, k_bmax, k_glob = k_meta[k_tiles].unbind(1)
    # Some pair shares a block (or one side is global): the block ranges overlap.
    any_vis = (q_glob != 0) | (k_glob != 0) | ((k_bmin <= q_bmax) & (q_bmin <= k_bmax))
    # Every pair shares a block: one side is all global, or both sides are one and the same block.
    all_vis = (q_bmin > q_bmax) | (k_bmin > k_bmax) | ((q_bmin == q_bmax) & (k_bmin == k_bmax) & (q_bmin == k_bmin))
    if causal:
        any_vis &= k_min <= q_max  # not entirely in the causal future
        all_vis &= k_max <= q_min  # entirely in the causal past
    if window_left >= 0:
        any_vis &= k_max >= q_min - window_left
        all_vis &= k_min >= q_max - window_left
    return any_vis, all_vis


@dataclasses.dataclass
class Csr:
    """Per row tile of one side, the visible tiles of the other side, as work items.

    ``work`` int32 ``[items, 8]``: (first row, end row of its sequence, end row of the other side's
    sequence, e_start, e_mid, e_end, dest, 0); entries ``[e_start, e_mid)`` of ``rows`` are tiles
    visible in full and ``[e_mid, e_end)`` partially visible ones; ``dest`` is -1 (write the
    output) or the first row of this item's slot in the split partials. Items are sorted by
    descending ``e_end - e_start`` (longest first). ``rows`` int32 ``[nnz]``: first row of each
    listed tile. ``split_rows`` / ``split_local`` int64: output rows of split tiles and their row in
    the merged partials; ``split_tiles``, ``max_splits``: the partials' shape.
    """

    work: torch.Tensor
    rows: torch.Tensor
    split_rows: torch.Tensor
    split_local: torch.Tensor
    split_tiles: int
    max_splits: int

    @property
    def items(self) -> int:
        return self.work.shape[0]


def _csr(row_start, row_end, other_end, other_start, row_of_pair, other_of_pair, masked, num_rows, block,
         split_len: Optional[int]) -> Csr:
    """Build a ``Csr`` from the visible pairs (row tile, other tile, masked) of ``num_rows`` row tiles."""
    dev = row_start.device
    order = torch.argsort(row_of_pair * 2 + masked.long(), stable=True)  # by row tile, full ones first
    rows = other_start[other_of_pair[order]].int()
    n = torch.bincount(row_of_pair, minlength=num_rows)
    n_full = torch.bincount(row_of_pair[~masked], minlength=num_rows)
    ptr = torch.cat([n.new_zeros(1), torch.cumsum(n, 0)])
    if split_len:
        splits = torch.clamp((n + split_len - 1) // split_len, min=1)
    else:
        splits = torch.ones_like(n)
    chunk = torch.clamp((n + splits - 1) // splits, min=1)
    item_row = torch.repeat_interleave(torch.arange(num_rows, device=dev), splits)
    first_item = torch.cumsum(splits, 0) - splits
    part = torch.arange(item_row.numel(), device=dev) - first_item[item_row]
    e_start = torch.minimum(ptr[item_row] + part * chunk[item_row], ptr[item_row + 1])
    e_end = torch.minimum(e_start + chunk[item_row], ptr[item_row + 1])
    e_mid = torch.clamp(ptr[item_row] + n_full[item_row], e_start, e_end)
    is_split = splits > 1
    split_tiles = int(is_split.sum())
    max_splits = int(splits.max()) if num_rows else 1
    split_idx = torch.cumsum(is_split.long(), 0) - 1  # rank of a split row tile among them
    dest = torch.where(is_split[item_row], part * (split_tiles * block) + split_idx[item_row] * block, -1)
    work = torch.stack([row_start[item_row], row_end[item_row], other_end[item_row], e_start, e_mid, e_end, dest,
                        torch.zeros_like(dest)], 1)
    work = work[torch.argsort(e_end - e_start, descending=True, stable=True)].int().contiguous()
    # output rows of the split tiles (valid rows only) and their rows in the merged partials
    tiles = is_split.nonzero().flatten()
    local = torch.arange(block, device=dev)
    grid_rows = row_start[tiles][:, None] + local[None, :]
    valid = grid_rows < row_end[tiles][:, None]
    split_local = (torch.arange(split_tiles, device=dev)[:, None] * block + local[None, :])[valid]
    return Csr(work, rows.contiguous(), grid_rows[valid], split_local, split_tiles, max_splits)


def _visible_pairs(q_side, k_side, causal: bool, window_left: int, bn: int):
    """(q tile, k tile, masked) of every tile pair that can be visible, sequence by sequence."""
    q_off, q_seq, _, q_meta = q_side
    k_off, _, k_start, k_meta, k_end = k_side
    dev = q_meta.device
    nk = (k_off[1:] - k_off[:-1])[q_seq]  # key tiles of each query tile's sequence
    bounds = torch.cumsum(nk, 0)
    qs, ks, ms = [], [], []
    lo, num_q = 0, q_seq.numel()
    cum = bounds.tolist()
    while lo < num_q:  # chunks of query tiles with at most _PAIR_CHUNK pairs (at least one tile)
        base = cum[lo - 1] if lo else 0
        hi = lo + 1
        while hi < num_q and cum[hi] - base <= _PAIR_CHUNK:
            hi += 1
        qt = torch.arange(lo, hi, device=dev)
        cnt = nk[lo:hi]
        pq = torch.repeat_interleave(qt, cnt)
        first = torch.cumsum(cnt, 0) - cnt
        pk = k_off[q_seq[pq]] + torch.arange(pq.numel(), device=dev) - first[pq - lo]
        any_vis, all_vis = tile_pairs(q_meta, k_meta, pq, pk, causal, window_left)
        full = all_vis & (k_start[pk] + bn <= k_end[pk])  # a partial key tile needs the row mask
        qs.append(pq[any_vis])
        ks.append(pk[any_vis])
        ms.append(~full[any_vis])
        lo = hi
    if not qs:
        e = torch.zeros(0, dtype=torch.long, device=dev)
        return e, e, e.bool()
    return torch.cat(qs), torch.cat(ks), torch.cat(ms)


@dataclasses.dataclass
class VarlenPlan:
    """Everything the kernels need besides q, k, v for one (cu, pos, blk) pair of sides, tile sizes,
    causality and window: int32 index tensors with defaults filled, the forward's ``Csr`` by query
    tile (``by_q``) and, for the backward, the same pairs by key tile (``by_k``)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    q_pos: torch.Tensor
    kv_pos: torch.Tensor
    q_block: torch.Tensor
    kv_block: torch.Tensor
    by_q: Csr
    by_k: Optional[Csr]


def build_plan(cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, total_q: int, total_k: int, *, block_m: int,
               block_n: int, causal: bool, window_left: int, backward: bool, split_len: Optional[int] = None,
               split_slots: Optional[float] = None) -> VarlenPlan:
    """The launch plan (see ``VarlenPlan``). The forward splits a query tile that sees more than
    ``split_len`` key tiles over several programs; without ``split_len``, ``split_slots`` (parallel
    programs per head) sets it so that no program has more than 1/slots of the work (at least
    ``MIN_SPLIT`` tiles); with neither, nothing is split."""
    cu_q, q_pos, q_block = _defaults(cu_q, q_pos, q_block, total_q)
    cu_k, kv_pos, kv_block = _defaults(cu_k, kv_pos, kv_block, total_k)
    q_off, q_seq, q_start, q_meta = tile_metadata(cu_q, q_pos, q_block, total_q, block_m)
    k_off, k_seq, k_start, k_meta = tile_metadata(cu_k, kv_pos, kv_block, total_k, block_n)
    cq, ck = cu_q.long(), cu_k.long()
    q_end, k_end = cq[1:][q_seq], ck[1:][k_seq]
    window_left = int(window_left) if window_left is not None and window_left >= 0 else -1
    pq, pk, masked = _visible_pairs((q_off, q_seq, q_start, q_meta), (k_off, k_seq, k_start, k_meta, k_end),
                                    causal, window_left, block_n)
    if split_len is None and split_slots:
        split_len = max(MIN_SPLIT, math.ceil(pq.numel() / split_slots))
    by_q = _csr(q_start, q_end, ck[1:][q_seq], k_start, pq, pk, masked, q_seq.numel(), block_m, split_len)
    by_k = None
    if backward:
        by_k = _csr(k_start, k_end, cq[1:][k_seq], q_start, pk, pq, masked, k_seq.numel(), block_n, None)
    return VarlenPlan(cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, by_q, by_k)


def _defaults(cu, pos, blk, total):
    """int32 offsets, positions (default: arange per sequence) and blocks (default: -1), owned by
    the plan (copies: a cached plan must not change when the caller edits its tensors).

    Engines pass int64 as often as int32; the kernels read int32 (values fit: validated)."""
    if pos is None:
        idx = torch.arange(total, device=cu.device)
        seq = torch.searchsorted(cu[1:].long(), idx, right=True)
        pos = (idx - cu.long()[seq]).int()
    if blk is None:
        blk = torch.full((total,), -1, dtype=torch.int32, device=cu.device)
    return tuple(t.to(torch.int32, copy=True) for t in (cu, pos, blk))

