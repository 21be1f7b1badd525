"""Triton kernels of ``ragattn.varlen_attention``: packed attention with a position/block mask.

Query ``i`` sees key ``j`` of the same sequence iff ``(not causal or kv_pos[j] <= q_pos[i])`` and
``(q_block[i] == kv_block[j] or q_block[i] == -1 or kv_block[j] == -1)`` and
``(window_left < 0 or kv_pos[j] >= q_pos[i] - window_left)``.

Masked keys are never read into a sum: in partially visible tile pairs the scores are selected
(``where``), not multiplied by a 0/1 mask, and the second dot of each pair (P@V, dS@K, P^T@dO,
dS^T@Q) zeroes non-finite operands first (``_dot_finite``), because 0 * NaN is NaN; the forward
puts NaN back where a visible value was non-finite (``_dot_visible``: issue 14's per-element
rule; gradients are specified for finite visible inputs only). Fully visible tile pairs take the
fast path without any mask.

The mask is never materialised. A plan (``VarlenPlan``, built once per index tensors on the
host, cached) summarises each query and key tile by five numbers (min/max position, min/max
non-global block id, "has a global token") and lists, per query tile, the key tiles that can be
visible to it (a CSR): first the ones visible in full, then the partially visible ones. The
kernels run two plain ``for`` loops over that list (the mask-free one, then the masked one), so
Triton software-pipelines the K/V loads (``cp.async``, ``num_stages``). Work items launch
longest first, and a query tile that sees many key tiles (a global question block) is split over
several programs whose partial (out, lse) are merged by ``merge_attention_states``' split kernel.
Block-Attention's 64 chunks of 500 tokens therefore cost about what 64 independent 500-token
prefills cost, and the global tail runs beside them instead of after them.

On Hopper the mask-free loop can load its K/V tiles through tensor descriptors (TMA), behind the
config table's ``tma`` flag or ``RAGATTN_VARLEN_TMA=1`` (``_tma_descriptors``), the plain pointer
loads being the fallback (padded head dims, older GPUs, unaligned rows) and the default until a
GPU has measured it. Tiles, warps and stages come from ``configs/varlen_attention.json`` per GPU.

Layout: q ``[total_q, H, D]``, k/v ``[total_k, H_kv, D]`` (contiguous), GQA by index
(query head ``h`` reads kv head ``h // GROUP``). Work is split as in FlashAttention-2:
forward and dq one program per (query head, work item), dk/dv one program per (kv head, key
tile) looping over the group's query heads, so no atomics are needed (the backward does not
split rows).
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from ragattn.triton_kernels.merge_attention_states import merge_split_states
from ragattn.triton_kernels.gpu_configs import DEFAULT, device_name as _device_name, dtype_class, get_config
from ragattn.triton_kernels.plan_cache import IndexPlanCache

# The interpreter's tl.dot on bf16 is wrong: upcast the operands to fp32 there (and only there).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_INT_MAX = 2**31 - 1
_INT_MIN = -(2**31)
_LOG2E = 1.4426950408889634
_META = 5  # min_pos, max_pos, min_block (non-global), max_block (non-global), has_global
_WORK = 8  # a work item: row start, row end (sequence), other side's end, e_start, e_mid, e_end, dest, 0
_PAIR_CHUNK = 1 << 22  # tile pairs examined at once while planning (bounds the plan's memory)


# ----------------------------------------------------------------------------------------------
# The plan (plain torch on the inputs' device; syncs with the host, built once per index tensors)
# ----------------------------------------------------------------------------------------------
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
    ``_MIN_SPLIT`` tiles); with neither, nothing is split."""
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
        split_len = max(_MIN_SPLIT, math.ceil(pq.numel() / split_slots))
    by_q = _csr(q_start, q_end, ck[1:][q_seq], k_start, pq, pk, masked, q_seq.numel(), block_m, split_len)
    by_k = None
    if backward:
        by_k = _csr(k_start, k_end, cq[1:][k_seq], q_start, pk, pq, masked, k_seq.numel(), block_n, None)
    return VarlenPlan(cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, by_q, by_k)


# ----------------------------------------------------------------------------------------------
# Kernel helpers
# ----------------------------------------------------------------------------------------------
@triton.jit
def _window_start(q_pos, window_left):
    """Smallest key position each query's window admits, as int32: ``q_pos - window_left`` computed
    in int64 and clamped at INT_MIN (exact: no position is below it), so the per-tile compare
    stays 32-bit."""
    return tl.maximum(q_pos.to(tl.int64) - window_left, -2147483648).to(tl.int32)


@triton.jit
def _pair_mask(q_pos, q_lo, q_blk, k_pos, k_blk, k_valid, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Element-wise visibility [BLOCK_M, BLOCK_N] of a partially visible tile pair (``q_lo``: the
    queries' ``_window_start``)."""
    vis = (q_blk[:, None] == k_blk[None, :]) | (q_blk[:, None] == -1) | (k_blk[None, :] == -1)
    vis = vis & k_valid[None, :]
    if CAUSAL:
        vis = vis & (k_pos[None, :] <= q_pos[:, None])
    if WINDOW:
        vis = vis & (k_pos[None, :] >= q_lo[:, None])
    return vis


@triton.jit
def _dot_finite(acc, a, b, PREC: tl.constexpr):
    """``acc + a @ b`` with the non-finite elements of ``b`` read as 0: the backward's second dots in
    partially visible tiles, where a masked row's NaN must not meet a 0 of ``a`` (gradients are
    specified for finite visible inputs only, so a visible one needs no NaN put back)."""
    finite = (b == b) & (tl.abs(b) < float("inf"))
    return tl.dot(a, tl.where(finite, b, 0.0).to(b.dtype), acc, input_precision=PREC)


@triton.jit
def _dot_visible(acc, a, vis, b, PREC: tl.constexpr):
    """``acc + a @ b`` for a partially visible tile: ``a`` [M, N] is 0 wherever ``vis`` [M, N] is
    False, and ``b`` [N, D] rows may hold non-finite values of keys (or queries) that are not visible.

    0 * NaN is NaN, so non-finite elements of ``b`` are zeroed for the dot; only when the tile has
    one, a second dot counts the visible non-finite elements per output (fp16 counts: exact up to
    2048, and half the registers of fp32) and makes those outputs NaN (a visible non-finite value
    still propagates). Fully visible tiles never come here.
    """
    finite = (b == b) & (tl.abs(b) < float("inf"))
    acc = _dot_finite(acc, a, b, PREC)
    if tl.sum((finite == 0).to(tl.int32)) > 0:
        hits = tl.dot(vis.to(tl.float16), (finite == 0).to(tl.float16), out_dtype=tl.float16)
        acc = tl.where(hits > 0, float("nan"), acc)
    return acc


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax over one tile of base-2 scores: (p, alpha, l_new, m_new). A row with nothing
    visible yet keeps m = -inf, so it is shifted by 0 there."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _work_item(Work, item):
    """The 7 numbers of work item ``item`` (see ``Csr``)."""
    base = Work + item * 8
    return (tl.load(base), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3), tl.load(base + 4),
            tl.load(base + 5), tl.load(base + 6))


_GRID_AXIS = 65535  # CUDA's limit on grid axes y and z


def _launch(heads: int, csr: "Csr"):
    """(grid, work) of a launch over heads x ``csr``'s work items: heads on axis 0 (they vary
    fastest, so the longest item's heads start first), items on axes 1 and 2 (item = y + z * 65535:
    a long packed batch has more than 65535 items, 1M query rows are 16K-64K tiles), the work
    padded with empty items (no rows: they load and store nothing) up to a whole number of rows."""
    items, work = csr.items, csr.work
    rows = triton.cdiv(items, _GRID_AXIS)
    if rows > 1:
        pad = work.new_zeros(rows * _GRID_AXIS - items, work.shape[1])
        pad[:, 6] = -1   # dest -1: an empty item writes its (no) rows in place
        work = torch.cat([work, pad])
    return (heads, min(items, _GRID_AXIS), rows), work


@triton.jit
def _item():
    """This program's work item (see ``_launch``)."""
    return tl.program_id(1) + tl.program_id(2) * 65535


@triton.jit
def _load_rows(Ptr, offs, row_ok, col_off, offs_d, d_ok, stride, UPCAST: tl.constexpr):
    """Rows ``offs`` [R] of a [rows, heads, HEAD_DIM] tensor at column ``col_off`` (int64 offsets)."""
    x = tl.load(Ptr + offs.to(tl.int64)[:, None] * stride + col_off + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _key_tile(K, V, KPos, KBlk, offs_n, n_valid, col_off, offs_d, d_ok, stride, UPCAST: tl.constexpr):
    """K and V rows ``offs_n`` with their positions and block ids, for a tile whose keys need the
    pair mask (rows past ``n_valid`` read nothing: position 0, block -1)."""
    k = _load_rows(K, offs_n, n_valid, col_off, offs_d, d_ok, stride, UPCAST)
    v = _load_rows(V, offs_n, n_valid, col_off, offs_d, d_ok, stride, UPCAST)
    k_pos = tl.load(KPos + offs_n, mask=n_valid, other=0)
    k_blk = tl.load(KBlk + offs_n, mask=n_valid, other=-1)
    return k, v, k_pos, k_blk


@triton.jit
def _low(x, Ref, UPCAST: tl.constexpr):
    """``x`` in the element type of ``Ref`` (the second dot runs in the input dtype, as FlashAttention's)."""
    x = x.to(Ref.dtype.element_ty)
    if UPCAST:
        x = x.to(tl.float32)
    return x


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------
@triton.jit
def _fwd_kernel(
    Q, K, V, Out, Lse, Parts, PartsLse, QPos, KPos, QBlk, KBlk, Work, KvRows,
    qk_scale, num_heads, window_left,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    KDesc=None, VDesc=None, USE_TMA: tl.constexpr = False,
):
    h = tl.program_id(0)  # heads vary fastest: the longest work item's heads launch first
    item = _item()
    q_start, q_end, k_end, e_start, e_mid, e_end, dest = _work_item(Work, item)
    kvh = h // GROUP

    offs_m = q_start + tl.arange(0, BLOCK_M)
    m_valid = offs_m < q_end
    offs_d = tl.arange(0, BLOCK_D)  # head_dim padded to a power of two, masked
    d_ok = offs_d < HEAD_DIM
    q_stride = num_heads * HEAD_DIM
    kv_stride = (num_heads // GROUP) * HEAD_DIM
    q = _load_rows(Q, offs_m, m_valid, h * HEAD_DIM, offs_d, d_ok, q_stride, UPCAST)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    all_rows = tl.full([BLOCK_N], 1, tl.int1)

    # Key tiles visible in full (and full-length): no mask at all.
    for e in range(e_start, e_mid):
        if USE_TMA:  # Hopper's tensor memory accelerator: descriptors over K/V as [total_k, H_kv * D]
            row0 = tl.load(KvRows + e)
            k = KDesc.load([row0, kvh * HEAD_DIM])
            v = VDesc.load([row0, kvh * HEAD_DIM])
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
        else:
            offs_n = tl.load(KvRows + e) + tl.arange(0, BLOCK_N)
            k = _load_rows(K, offs_n, all_rows, kvh * HEAD_DIM, offs_d, d_ok, kv_stride, UPCAST)
            v = _load_rows(V, offs_n, all_rows, kvh * HEAD_DIM, offs_d, d_ok, kv_stride, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # log2 domain
        p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(_low(p, V, UPCAST), v, input_precision=PREC)

    # Partially visible key tiles: mask the scores, and read no masked V into P@V (0 * NaN).
    q_pos = tl.load(QPos + offs_m, mask=m_valid, other=0)
    q_lo = _window_start(q_pos, window_left)
    q_blk = tl.load(QBlk + offs_m, mask=m_valid, other=-1)
    for e in range(e_mid, e_end):
        offs_n = tl.load(KvRows + e) + tl.arange(0, BLOCK_N)
        n_valid = offs_n < k_end
        k, v, k_pos, k_blk = _key_tile(K, V, KPos, KBlk, offs_n, n_valid, kvh * HEAD_DIM, offs_d, d_ok, kv_stride,
                                       UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        vis = _pair_mask(q_pos, q_lo, q_blk, k_pos, k_blk, n_valid, CAUSAL, WINDOW)
        p, alpha, l_i, m_i = _softmax_step(tl.where(vis, s, float("-inf")), m_i, l_i)
        acc = _dot_visible(acc * alpha[:, None], _low(p, V, UPCAST), vis, v, PREC)

    empty = l_i == 0.0  # no visible key: out 0, lse -inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) / 1.4426950408889634)
    if dest < 0:
        tl.store(Out + offs_m.to(tl.int64)[:, None] * q_stride + h * HEAD_DIM + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=m_valid[:, None] & d_ok[None, :])
        tl.store(Lse + offs_m.to(tl.int64) * num_heads + h, lse, mask=m_valid)
    else:  # one split of a long row: fp32 partials, merged by the launcher
        rows = (dest + tl.arange(0, BLOCK_M)).to(tl.int64)
        tl.store(Parts + rows[:, None] * q_stride + h * HEAD_DIM + offs_d[None, :], out,
                 mask=m_valid[:, None] & d_ok[None, :])
        tl.store(PartsLse + rows * num_heads + h, lse, mask=m_valid)


# ----------------------------------------------------------------------------------------------
# Backward: delta = rowsum(dO * O), then dq (per query tile) and dk/dv (per key tile)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _bwd_preprocess(Out, DOut, Delta, total_rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # rows of the [total_q * H, D] view
    valid = rows < total_rows
    offs_d = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    offs = rows.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(Out + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DOut + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + rows, tl.sum(o * do, 1), mask=valid)


@triton.jit
def _row_stats(Lse, Delta, offs_m, m_valid, h, num_heads):
    """(base-2 lse, delta) [BLOCK_M] of query rows; rows with no visible key get lse = +inf (P = 0)."""
    row = offs_m.to(tl.int64) * num_heads + h
    lse = tl.load(Lse + row, mask=m_valid, other=float("inf")) * 1.4426950408889634
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(Delta + row, mask=m_valid, other=0.0)
    return lse, delta


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, QPos, KPos, QBlk, KBlk, Work, KvRows,
    qk_scale, sm_scale, num_heads, window_left,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    h = tl.program_id(0)
    item = _item()
    q_start, q_end, k_end, e_start, e_mid, e_end, dest = _work_item(Work, item)
    kvh = h // GROUP

    offs_m = q_start + tl.arange(0, BLOCK_M)
    m_valid = offs_m < q_end
    offs_d = tl.arange(0, BLOCK_D)  # head_dim padded to a power of two, masked
    d_ok = offs_d < HEAD_DIM
    q_stride = num_heads * HEAD_DIM
    kv_stride = (num_heads // GROUP) * HEAD_DIM
    q = _load_rows(Q, offs_m, m_valid, h * HEAD_DIM, offs_d, d_ok, q_stride, UPCAST)
    do = _load_rows(DOut, offs_m, m_valid, h * HEAD_DIM, offs_d, d_ok, q_stride, UPCAST)
    lse, delta = _row_stats(Lse, Delta, offs_m, m_valid, h, num_heads)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    all_rows = tl.full([BLOCK_N], 1, tl.int1)

    for e in range(e_start, e_mid):  # key tiles visible in full
        offs_n = tl.load(KvRows + e) + tl.arange(0, BLOCK_N)
        k = _load_rows(K, offs_n, all_rows, kvh * HEAD_DIM, offs_d, d_ok, kv_stride, UPCAST)
        v = _load_rows(V, offs_n, all_rows, kvh * HEAD_DIM, offs_d, d_ok, kv_stride, UPCAST)
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale - lse[:, None])
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None])
        dq += tl.dot(_low(ds, K, UPCAST), k, input_precision=PREC)

    q_pos = tl.load(QPos + offs_m, mask=m_valid, other=0)
    q_lo = _window_start(q_pos, window_left)
    q_blk = tl.load(QBlk + offs_m, mask=m_valid, other=-1)
    for e in range(e_mid, e_end):  # partially visible: select, so a masked key's NaN stays out of dq
        offs_n = tl.load(KvRows + e) + tl.arange(0, BLOCK_N)
        n_valid = offs_n < k_end
        k, v, k_pos, k_blk = _key_tile(K, V, KPos, KBlk, offs_n, n_valid, kvh * HEAD_DIM, offs_d, d_ok, kv_stride,
                                       UPCAST)
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale - lse[:, None])
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None])
        vis = _pair_mask(q_pos, q_lo, q_blk, k_pos, k_blk, n_valid, CAUSAL, WINDOW)
        dq = _dot_finite(dq, _low(tl.where(vis, ds, 0.0), K, UPCAST), k, PREC)
    tl.store(DQ + offs_m.to(tl.int64)[:, None] * q_stride + h * HEAD_DIM + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=m_valid[:, None] & d_ok[None, :])


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, QPos, KPos, QBlk, KBlk, Work, QRows,
    qk_scale, sm_scale, num_heads, window_left,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    kvh = tl.program_id(0)
    item = _item()
    k_start, k_end, q_end, e_start, e_mid, e_end, dest = _work_item(Work, item)

    offs_n = k_start + tl.arange(0, BLOCK_N)
    n_valid = offs_n < k_end
    offs_d = tl.arange(0, BLOCK_D)  # head_dim padded to a power of two, masked
    d_ok = offs_d < HEAD_DIM
    q_stride = num_heads * HEAD_DIM
    kv_stride = (num_heads // GROUP) * HEAD_DIM
    k, v, k_pos, k_blk = _key_tile(K, V, KPos, KBlk, offs_n, n_valid, kvh * HEAD_DIM, offs_d, d_ok, kv_stride, UPCAST)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(GROUP):  # the query heads sharing this kv head
        h = kvh * GROUP + g
        for e in range(e_start, e_mid):  # query tiles that see this (full-length) key tile in full
            offs_m = tl.load(QRows + e) + tl.arange(0, BLOCK_M)
            m_valid = offs_m < q_end
            q = _load_rows(Q, offs_m, m_valid, h * HEAD_DIM, offs_d, d_ok, q_stride, UPCAST)
            do = _load_rows(DOut, offs_m, m_valid, h * HEAD_DIM, offs_d, d_ok, q_stride, UPCAST)
            lse, delta = _row_stats(Lse, Delta, offs_m, m_valid, h, num_heads)
            # Transposed scores [BLOCK_N, BLOCK_M] so that dk, dv come out of plain dots.
            p_t = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale - lse[None, :])
            ds_t = p_t * (tl.dot(v, tl.trans(do), input_precision=PREC) - delta[None, :])
            dv += tl.dot(_low(p_t, Q, UPCAST), do, input_precision=PREC)
            dk += tl.dot(_low(ds_t, Q, UPCAST), q, input_precision=PREC)
        for e in range(e_mid, e_end):  # partially: nothing of a query that cannot see a key reaches it
            offs_m = tl.load(QRows + e) + tl.arange(0, BLOCK_M)
            m_valid = offs_m < q_end
            q = _load_rows(Q, offs_m, m_valid, h * HEAD_DIM, offs_d, d_ok, q_stride, UPCAST)
            do = _load_rows(DOut, offs_m, m_valid, h * HEAD_DIM, offs_d, d_ok, q_stride, UPCAST)
            lse, delta = _row_stats(Lse, Delta, offs_m, m_valid, h, num_heads)
            q_pos = tl.load(QPos + offs_m, mask=m_valid, other=0)
            q_lo = _window_start(q_pos, window_left)
            q_blk = tl.load(QBlk + offs_m, mask=m_valid, other=-1)
            p_t = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale - lse[None, :])
            ds_t = p_t * (tl.dot(v, tl.trans(do), input_precision=PREC) - delta[None, :])
            vis = tl.trans(_pair_mask(q_pos, q_lo, q_blk, k_pos, k_blk, n_valid, CAUSAL, WINDOW))
            dv = _dot_finite(dv, _low(tl.where(vis, p_t, 0.0), Q, UPCAST), do, PREC)
            dk = _dot_finite(dk, _low(tl.where(vis, ds_t, 0.0), Q, UPCAST), q, PREC)
    tl.store(DK + offs_n.to(tl.int64)[:, None] * kv_stride + kvh * HEAD_DIM + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=n_valid[:, None] & d_ok[None, :])
    tl.store(DV + offs_n.to(tl.int64)[:, None] * kv_stride + kvh * HEAD_DIM + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=n_valid[:, None] & d_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Launch helpers
# ----------------------------------------------------------------------------------------------
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


# A model calls the op once per layer with the same index tensors: keep the last few plans (the
# hit rules are those of ragattn.triton_kernels.plan_cache: same objects and versions, or equal contents).
_PLAN_CACHE = IndexPlanCache(8)


def _cached_plan(index, total_q, total_k, **params) -> VarlenPlan:
    """``build_plan`` for ``index`` = (cu_q, cu_k, q_pos, kv_pos, q_block, kv_block), cached."""
    key = (total_q, total_k, tuple(sorted(params.items())))
    return _PLAN_CACHE.get(index, key, lambda: build_plan(*index, total_q, total_k, **params))


MAX_HEAD_DIM = 256
_MIN_SPLIT = 16  # key tiles per split at least: a split costs a partial write and a merge


def block_d(head_dim: int) -> int:
    """The head dim padded to a power of two (at least 16, tl.dot's minimum); the padding is masked."""
    return max(16, triton.next_power_of_2(head_dim))


def config_key(head_dim: int, kernel: str, dtype: torch.dtype = torch.bfloat16, window: bool = False) -> str:
    """The shape class of a launch in ``configs/varlen_attention.json``: kernel, dtype, padded head dim."""
    d = block_d(head_dim)
    dclass = "d64" if d <= 64 else "d128" if d <= 128 else "d256"
    return f"{kernel}/{dtype_class(dtype)}/{dclass}" + ("/window" if window and kernel == "fwd" else "")


def _config(head_dim: int, kernel: str, dtype: torch.dtype = torch.bfloat16, window: bool = False,
            device_name: Optional[str] = None):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of ``kernel`` ("fwd", "dq" or "dkdv") for the padded
    head dim and dtype on ``device_name`` (``torch.cuda.get_device_name``; None: the table's
    heuristic default), from ``configs/varlen_attention.json`` (``gpu_configs``). The default
    entries are spill-free for sm_90 (``python -m ragattn.bench.sm90``); the partially visible
    loops' NaN guards (operands through registers) are what bounds the tiles, and a sliding
    window's compare costs the 16-bit forward half its key tile at d > 64. The interpreter wants
    few, big tiles."""
    c = get_config("varlen_attention", None if _INTERPRET else (device_name or DEFAULT),
                   config_key(head_dim, kernel, dtype, window))
    return c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"]


def _tma_descriptors(k, v, head_dim: int, block_n: int, wanted: bool):
    """(KDesc, VDesc) when the forward's mask-free loop loads K/V by TMA, else (None, None).

    ``RAGATTN_VARLEN_TMA=1``/``0`` forces it on/off (``1`` also in the interpreter, which emulates
    descriptors: how the tests reach this path), else the config table's ``tma`` flag decides
    (``wanted``; no entry sets it until a GPU has measured it). Needs a GPU of compute capability
    >= 9 (or the interpreter), a head dim that is its own power-of-two tile (a padded tile would
    read the next head's columns) and 16-byte aligned rows."""
    flag = os.environ.get("RAGATTN_VARLEN_TMA", "").strip()
    if not (flag == "1" or (wanted and flag != "0")):
        return None, None
    if _INTERPRET:
        if flag != "1":
            return None, None
    elif k.device.type != "cuda" or torch.cuda.get_device_capability(k.device)[0] < 9:
        return None, None
    elt = k.element_size()
    row = k.shape[1] * head_dim
    if (block_d(head_dim) != head_dim or (row * elt) % 16 or any(t.data_ptr() % 16 for t in (k, v))
            or not (k.is_contiguous() and v.is_contiguous()) or k.shape[0] == 0):
        return None, None
    from triton.tools.tensor_descriptor import TensorDescriptor

    block = [block_n, head_dim]
    return (TensorDescriptor.from_tensor(k.view(k.shape[0], row), block),
            TensorDescriptor.from_tensor(v.view(v.shape[0], row), block))


def _prec(q):
    return "ieee" if (q.dtype == torch.float32 or _INTERPRET) else "tf32"


def _split_slots(q, num_heads: int) -> Optional[float]:
    """Programs' worth of parallel slots per head: long query rows are split until each is at most
    1/slots of the total work (the GPU: 2 CTAs on each SM); no split in the interpreter."""
    if q.device.type != "cuda":
        return None
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return 2 * sms / num_heads


def varlen_attention_fwd(q, k, v, cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, causal, scale, window_left=-1, *,
                         block_m=None, block_n=None, split_len=None, out=None, lse=None):
    """Forward launcher: ``(out [total_q, H, D] like q, lse float32 [total_q, H])``. Inputs contiguous;
    ``out``/``lse`` (optional) are contiguous preallocated outputs, written in place. ``split_len``
    (tests): split query tiles that see more than that many key tiles (default: by SM count)."""
    total_q, num_heads, head_dim = q.shape
    total_k, num_kv_heads, _ = k.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    window = int(window_left) if window_left is not None and window_left >= 0 else -1
    dev_name = _device_name(q.device)
    bm, bn, warps, stages = _config(head_dim, "fwd", q.dtype, window >= 0, dev_name)
    tma = bool(get_config("varlen_attention", dev_name or DEFAULT, config_key(head_dim, "fwd", q.dtype, window >= 0))
               .get("tma", False)) and not _INTERPRET
    bm, bn = block_m or bm, block_n or bn
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(total_q, num_heads, dtype=torch.float32, device=q.device) if lse is None else lse
    if total_q == 0 or cu_q.numel() <= 1:
        return out, lse
    plan = _cached_plan((cu_q, cu_k, q_pos, kv_pos, q_block, kv_block), total_q, total_k, block_m=bm, block_n=bn,
                        causal=bool(causal), window_left=window, backward=False, split_len=split_len,
                        split_slots=None if split_len else _split_slots(q, num_heads))
    csr = plan.by_q
    parts_rows = csr.split_tiles * bm
    parts = torch.empty(csr.max_splits if parts_rows else 0, parts_rows, num_heads, head_dim, dtype=torch.float32,
                        device=q.device)
    parts_lse = torch.full(parts.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    if csr.items:
        grid, work = _launch(num_heads, csr)
        k_desc, v_desc = _tma_descriptors(k, v, head_dim, bn, tma)
        _fwd_kernel[grid](
            q, k, v, out, lse, parts, parts_lse, plan.q_pos, plan.kv_pos, plan.q_block, plan.kv_block, work, csr.rows,
            scale * _LOG2E, num_heads, max(window, 0),
            GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=bm, BLOCK_N=bn,
            CAUSAL=bool(causal), WINDOW=window >= 0, UPCAST=_INTERPRET, PREC=_prec(q),
            num_warps=warps, num_stages=stages, KDesc=k_desc, VDesc=v_desc, USE_TMA=k_desc is not None,
        )
    if parts_rows:  # merge the splits of long rows, then put their valid rows in place
        merged = torch.empty(parts_rows, num_heads, head_dim, dtype=out.dtype, device=q.device)
        merged_lse = torch.empty(parts_rows, num_heads, dtype=torch.float32, device=q.device)
        merge_split_states(parts, parts_lse, merged, merged_lse)
        out.index_copy_(0, csr.split_rows, merged.index_select(0, csr.split_local))
        lse.index_copy_(0, csr.split_rows, merged_lse.index_select(0, csr.split_local))
    return out, lse


def varlen_attention_bwd(dout, q, k, v, out, lse, cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, causal, scale,
                         window_left=-1, *, block_m=None, block_n=None):
    """Backward launcher: ``(dq, dk, dv)`` in the inputs' dtypes. Inputs contiguous."""
    total_q, num_heads, head_dim = q.shape
    total_k, num_kv_heads, _ = k.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if cu_q.numel() <= 1 or (total_q == 0 and total_k == 0):
        return dq.zero_(), dk.zero_(), dv.zero_()
    window = int(window_left) if window_left is not None and window_left >= 0 else -1
    delta = torch.empty(total_q, num_heads, dtype=torch.float32, device=q.device)
    rows = total_q * num_heads
    if rows:
        pre_block = 64
        _bwd_preprocess[(triton.cdiv(rows, pre_block),)](out, dout, delta, rows, HEAD_DIM=head_dim,
                                                          BLOCK_D=block_d(head_dim), BLOCK=pre_block)
    index = (cu_q, cu_k, q_pos, kv_pos, q_block, kv_block)
    configs = {kernel: _config(head_dim, kernel, q.dtype, window >= 0, _device_name(q.device)) for kernel in ("dq", "dkdv")}
    configs = {kernel: (block_m or c[0], block_n or c[1]) + c[2:] for kernel, c in configs.items()}
    for kernel, (bm, bn, warps, stages) in configs.items():
        # one plan serves both kernels when their tiles agree
        both = configs["dq"][:2] == configs["dkdv"][:2]
        plan = _cached_plan(index, total_q, total_k, block_m=bm, block_n=bn, causal=bool(causal), window_left=window,
                            backward=both or kernel == "dkdv", split_len=None, split_slots=None)
        args = (plan.q_pos, plan.kv_pos, plan.q_block, plan.kv_block)
        common = dict(GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=bm,
                      BLOCK_N=bn, CAUSAL=bool(causal), WINDOW=window >= 0, UPCAST=_INTERPRET, PREC=_prec(q),
                      num_warps=warps, num_stages=stages)
        if kernel == "dq" and plan.by_q.items:
            grid, work = _launch(num_heads, plan.by_q)
            _bwd_dq_kernel[grid](
                q, k, v, dout, lse, delta, dq, *args, work, plan.by_q.rows,
                scale * _LOG2E, scale, num_heads, max(window, 0), **common,
            )
        if kernel == "dkdv" and plan.by_k.items:
            grid, work = _launch(num_kv_heads, plan.by_k)
            _bwd_dkdv_kernel[grid](
                q, k, v, dout, lse, delta, dk, dv, *args, work, plan.by_k.rows,
                scale * _LOG2E, scale, num_heads, max(window, 0), **common,
            )
    return dq, dk, dv
