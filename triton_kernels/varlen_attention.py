"""Triton kernels of ``ragattn.varlen_attention``: packed attention with a position/block mask.

Query ``i`` sees key ``j`` of the same sequence iff ``(not causal or kv_pos[j] <= q_pos[i])`` and
``(q_block[i] == kv_block[j] or q_block[i] == -1 or kv_block[j] == -1)`` and
``(window_left < 0 or kv_pos[j] >= q_pos[i] - window_left)``.

Masked keys are never read into a sum: in partially visible tile pairs the scores are selected
(``where``), not multiplied by a 0/1 mask, and the second dot of each pair (P@V, dS@K, P^T@dO,
dS^T@Q) zeroes non-finite operands first (``_dot_visible``), because 0 * NaN is NaN. Fully
visible tile pairs take the unchanged fast path.

The mask is never materialised. Each query tile and key tile gets five numbers of metadata
(min/max position, min/max non-global block id, "has a global token"); a program skips every
tile pair whose blocks cannot meet or whose keys all lie in the causal future or left of every
query's sliding window, and drops the
element-wise mask for tile pairs that are visible in full. Block-Attention's 64 chunks of 500
tokens therefore cost about what 64 independent 500-token prefills cost.

Layout: q ``[total_q, H, D]``, k/v ``[total_k, H_kv, D]`` (contiguous), GQA by index
(query head ``h`` reads kv head ``h // GROUP``). Work is split as in FlashAttention-2:
forward and dq one program per (query tile, query head), dk/dv one program per (key tile, kv
head) looping over the group's query heads, so no atomics are needed.
"""
from __future__ import annotations

import collections
import math
import os

import torch
import triton
import triton.language as tl

# The interpreter's tl.dot on bf16 is wrong: upcast the operands to fp32 there (and only there).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_INT_MAX = 2**31 - 1
_INT_MIN = -(2**31)
_LOG2E = 1.4426950408889634
_META = 5  # min_pos, max_pos, min_block (non-global), max_block (non-global), has_global


# ----------------------------------------------------------------------------------------------
# Tile metadata (plain torch, no host sync: the tile count is bounded by total // BLOCK + batch)
# ----------------------------------------------------------------------------------------------
def tile_metadata(cu: torch.Tensor, pos: torch.Tensor, blk: torch.Tensor, total: int, block: int):
    """Split each sequence of ``cu`` into tiles of ``block`` rows and summarise each tile.

    Returns ``tile_off`` int32 ``[B + 1]`` (sequence ``b`` owns tiles ``tile_off[b]:tile_off[b+1]``),
    ``tile_seq`` int32 ``[T]`` (``B`` for the unused tail of the upper bound ``T``), ``tile_start``
    int32 ``[T]`` (first row), ``meta`` int32 ``[T, 5]`` and ``search`` int32 ``[T, 5]``: within each
    sequence, the prefix max of the tiles' max block, the suffix min of their min block, the next
    tile holding a global token (INT_MAX if none), the suffix min of min position and the prefix
    max of max position. All five are non-decreasing along a sequence's tiles, so a program finds
    the only tiles that can be visible to it by binary search instead of visiting every tile.
    """
    dev = cu.device
    batch = cu.numel() - 1
    cu64 = cu.long()
    ntiles = (cu64[1:] - cu64[:-1] + block - 1) // block
    tile_end = torch.cumsum(ntiles, 0)
    tile_off = torch.cat([tile_end.new_zeros(1), tile_end])
    num_tiles = total // block + batch  # each sequence adds at most one partial tile
    t = torch.arange(num_tiles, device=dev)
    tile_seq = torch.searchsorted(tile_end, t, right=True)
    seq_c = tile_seq.clamp(max=max(batch - 1, 0))
    tile_start = cu64[seq_c] + (t - tile_off[seq_c]) * block

    tok = torch.arange(total, device=dev)
    tok_seq = torch.searchsorted(cu64[1:], tok, right=True)
    tok_tile = tile_off[tok_seq] + (tok - cu64[tok_seq]) // block
    glob = blk == -1
    meta = torch.empty(num_tiles, _META, dtype=torch.int32, device=dev)
    fill = (_INT_MAX, _INT_MIN, _INT_MAX, _INT_MIN, 0)
    vals = (
        (pos, "amin"),
        (pos, "amax"),
        (torch.where(glob, _INT_MAX, blk), "amin"),
        (torch.where(glob, _INT_MIN, blk), "amax"),
        (glob.to(torch.int32), "amax"),
    )
    for i, ((src, how), f) in enumerate(zip(vals, fill)):
        col = torch.full((num_tiles,), f, dtype=torch.int32, device=dev)
        meta[:, i] = col.scatter_reduce(0, tok_tile, src.to(torch.int32), how, include_self=True)

    # Segmented scans: offset each sequence by 2^34 so that no value crosses a sequence boundary.
    seg = tile_seq * (1 << 34)

    def prefix_max(x):
        return torch.cummax(x.long() + seg, 0).values - seg

    def suffix_min(x):
        return torch.flip(torch.cummin(torch.flip(x.long() + seg, [0]), 0).values, [0]) - seg

    search = torch.stack(
        [
            prefix_max(meta[:, 3]),
            suffix_min(meta[:, 2]),
            suffix_min(torch.where(meta[:, 4] != 0, t, _INT_MAX)),
            suffix_min(meta[:, 0]),
            prefix_max(meta[:, 1]),
        ],
        dim=1,
    ).to(torch.int32).contiguous()
    return tile_off.int(), tile_seq.int(), tile_start.int(), meta, search


@triton.jit
def _search(Arr, col: tl.constexpr, lo, hi, value, STRICT: tl.constexpr, STEPS: tl.constexpr):
    """First tile t in [lo, hi) with Arr[t, col] >= value (> value if STRICT), else hi.

    Arr[:, col] is non-decreasing on [lo, hi) (a prefix max / suffix min of tile_metadata)."""
    a = lo
    b = hi
    for _ in range(STEPS):
        go = a < b
        mid = (a + b) // 2
        v = tl.load(Arr + mid * 5 + col, mask=go, other=0)
        if STRICT:
            right = go & (v <= value)
        else:
            right = go & (v < value)
        a = tl.where(right, mid + 1, a)
        b = tl.where(go & (right == 0), mid, b)
    return a


@triton.jit
def _next_candidate(Arr, x, a, b, end):
    """Smallest tile >= x that is global or inside the block-overlap range [a, b); end if none."""
    next_global = tl.load(Arr + x * 5 + 2, mask=x < end, other=end)
    nb = tl.where(x < a, a, x)
    nb = tl.where(nb < b, nb, end)
    return tl.minimum(tl.minimum(next_global, nb), end)


@triton.jit
def _kv_candidates(QMeta, q_tile, KSearch, lo, hi, window_left, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                   STEPS: tl.constexpr):
    """For a query tile: (first, a, b, end) so that only global key tiles and tiles in [a, b), all in
    [first, end), can be visible. end: first key tile entirely in the causal future of every query;
    first: first key tile not entirely left of every query's window."""
    first = lo
    if WINDOW:  # key tiles whose running max position is below the window start cannot be seen
        q_min_pos = tl.load(QMeta + q_tile * 5 + 0).to(tl.int64)
        first = _search(KSearch, 4, lo, hi, q_min_pos - window_left, False, STEPS)
    q_max_pos = tl.load(QMeta + q_tile * 5 + 1)
    q_bmin = tl.load(QMeta + q_tile * 5 + 2)
    q_bmax = tl.load(QMeta + q_tile * 5 + 3)
    q_glob = tl.load(QMeta + q_tile * 5 + 4)
    end = hi
    if CAUSAL:
        end = _search(KSearch, 3, lo, hi, q_max_pos, True, STEPS)
    a = _search(KSearch, 0, lo, hi, q_bmin, False, STEPS)
    b = tl.minimum(_search(KSearch, 1, lo, hi, q_bmax, True, STEPS), end)
    a = tl.where(q_glob != 0, lo, a)  # global queries see every block
    b = tl.where(q_glob != 0, end, b)
    return first, a, b, end


@triton.jit
def _q_candidates(KMeta, k_tile, QSearch, lo, hi, window_left, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                  STEPS: tl.constexpr):
    """For a key tile: (start, a, b, stop) so that only global query tiles and tiles in [a, b), all
    in [start, stop), can see it. start: first query tile not entirely in the causal past of every
    key; stop: first query tile whose every query's window starts right of every key."""
    stop = hi
    if WINDOW:  # query tiles whose running min position exceeds max key position + window
        k_max_pos = tl.load(KMeta + k_tile * 5 + 1).to(tl.int64)
        stop = _search(QSearch, 3, lo, hi, k_max_pos + window_left, True, STEPS)
    k_min_pos = tl.load(KMeta + k_tile * 5 + 0)
    k_bmin = tl.load(KMeta + k_tile * 5 + 2)
    k_bmax = tl.load(KMeta + k_tile * 5 + 3)
    k_glob = tl.load(KMeta + k_tile * 5 + 4)
    start = lo
    if CAUSAL:
        start = _search(QSearch, 4, lo, hi, k_min_pos, False, STEPS)
    a = tl.maximum(_search(QSearch, 0, lo, hi, k_bmin, False, STEPS), start)
    b = _search(QSearch, 1, lo, hi, k_bmax, True, STEPS)
    a = tl.where(k_glob != 0, start, a)
    b = tl.minimum(tl.where(k_glob != 0, hi, b), stop)
    return start, a, b, stop


@triton.jit
def _tiles_may_meet(QMeta, KMeta, q_tile, k_tile, window_left, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """(any pair visible, every pair visible) for a query tile and a key tile, from their metadata."""
    q_min_pos = tl.load(QMeta + q_tile * 5 + 0)
    q_max_pos = tl.load(QMeta + q_tile * 5 + 1)
    q_bmin = tl.load(QMeta + q_tile * 5 + 2)
    q_bmax = tl.load(QMeta + q_tile * 5 + 3)
    q_glob = tl.load(QMeta + q_tile * 5 + 4)
    k_min_pos = tl.load(KMeta + k_tile * 5 + 0)
    k_max_pos = tl.load(KMeta + k_tile * 5 + 1)
    k_bmin = tl.load(KMeta + k_tile * 5 + 2)
    k_bmax = tl.load(KMeta + k_tile * 5 + 3)
    k_glob = tl.load(KMeta + k_tile * 5 + 4)
    # Some pair shares a block (or one side is global): the block ranges overlap.
    any_vis = (q_glob != 0) | (k_glob != 0) | ((k_bmin <= q_bmax) & (q_bmin <= k_bmax))
    # Every pair shares a block: one side is all global, or both sides are one and the same block.
    all_vis = (q_bmin > q_bmax) | (k_bmin > k_bmax) | ((q_bmin == q_bmax) & (k_bmin == k_bmax) & (q_bmin == k_bmin))
    if CAUSAL:
        any_vis = any_vis & (k_min_pos <= q_max_pos)  # not entirely in the causal future
        all_vis = all_vis & (k_max_pos <= q_min_pos)  # entirely in the causal past
    if WINDOW:  # int64: q_pos - window_left must not wrap
        any_vis = any_vis & (k_max_pos.to(tl.int64) >= q_min_pos.to(tl.int64) - window_left)
        all_vis = all_vis & (k_min_pos.to(tl.int64) >= q_max_pos.to(tl.int64) - window_left)
    return any_vis, all_vis


@triton.jit
def _pair_mask(q_pos, q_blk, k_pos, k_blk, k_valid, window_left, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Element-wise visibility [BLOCK_M, BLOCK_N] of a partially visible tile pair."""
    vis = (q_blk[:, None] == k_blk[None, :]) | (q_blk[:, None] == -1) | (k_blk[None, :] == -1)
    vis = vis & k_valid[None, :]
    if CAUSAL:
        vis = vis & (k_pos[None, :] <= q_pos[:, None])
    if WINDOW:
        vis = vis & (k_pos.to(tl.int64)[None, :] >= q_pos.to(tl.int64)[:, None] - window_left)
    return vis


@triton.jit
def _dot_visible(a, vis, b, PREC: tl.constexpr):
    """``a @ b`` for a partially visible tile: ``a`` [M, N] is 0 wherever ``vis`` [M, N] is False,
    and ``b`` [N, D] rows may hold non-finite values of keys (or queries) that are not visible.

    0 * NaN is NaN, so non-finite elements of ``b`` are zeroed for the dot; only when the tile has
    one, a second dot counts the visible non-finite elements per output and makes those outputs
    NaN (a visible non-finite value still propagates). Fully visible tiles never come here.
    """
    finite = (b == b) & (tl.abs(b) < float("inf"))
    r = tl.dot(a, tl.where(finite, b, 0.0).to(b.dtype), input_precision=PREC)
    if tl.sum((finite == 0).to(tl.int32)) > 0:
        hits = tl.dot(vis.to(a.dtype), (finite == 0).to(a.dtype), input_precision=PREC)
        r = tl.where(hits > 0, float("nan"), r)
    return r


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax over one tile of base-2 scores: (p, alpha, l_new, m_new). A row with nothing
    visible yet keeps m = -inf, so it is shifted by 0 there."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------
@triton.jit
def _fwd_kernel(
    Q, K, V, Out, Lse, QPos, KPos, QBlk, KBlk,
    CuQ, CuK, QTileSeq, QTileStart, QMeta, KTileOff, KMeta, KSearch,
    qk_scale, num_batch, num_heads, window_left,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, STEPS: tl.constexpr,
):
    q_tile = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(QTileSeq + q_tile)
    if seq >= num_batch:  # beyond the last real tile of the upper-bound grid
        return
    kvh = h // GROUP
    q_start = tl.load(QTileStart + q_tile)
    q_end = tl.load(CuQ + seq + 1)
    k_seq_start = tl.load(CuK + seq)
    k_end = tl.load(CuK + seq + 1)
    k_tile_lo = tl.load(KTileOff + seq)
    k_tile_hi = tl.load(KTileOff + seq + 1)

    offs_m = q_start + tl.arange(0, BLOCK_M)
    m_valid = offs_m < q_end
    offs_d = tl.arange(0, BLOCK_D)  # head_dim padded to a power of two, masked
    d_ok = offs_d < HEAD_DIM
    q_stride = num_heads * HEAD_DIM
    kv_stride = (num_heads // GROUP) * HEAD_DIM
    q = tl.load(Q + offs_m.to(tl.int64)[:, None] * q_stride + h * HEAD_DIM + offs_d[None, :], mask=m_valid[:, None] & d_ok[None, :], other=0.0)
    q_pos = tl.load(QPos + offs_m, mask=m_valid, other=0)
    q_blk = tl.load(QBlk + offs_m, mask=m_valid, other=-1)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Visit only the key tiles that can be visible: global ones and the block-overlap range.
    first, a, b, k_tile_end = _kv_candidates(QMeta, q_tile, KSearch, k_tile_lo, k_tile_hi, window_left, CAUSAL, WINDOW, STEPS)
    k_tile = _next_candidate(KSearch, first, a, b, k_tile_end)
    while k_tile < k_tile_end:
        any_vis, all_vis = _tiles_may_meet(QMeta, KMeta, q_tile, k_tile, window_left, CAUSAL, WINDOW)
        if any_vis:  # tiles whose blocks cannot meet are skipped, not masked
            n_start = k_seq_start + (k_tile - k_tile_lo) * BLOCK_N
            offs_n = n_start + tl.arange(0, BLOCK_N)
            n_valid = offs_n < k_end
            kv_off = offs_n.to(tl.int64)[:, None] * kv_stride + kvh * HEAD_DIM + offs_d[None, :]
            k = tl.load(K + kv_off, mask=n_valid[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(V + kv_off, mask=n_valid[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # log2 domain
            if (all_vis == 0) | (n_start + BLOCK_N > k_end):
                # Partially visible: mask the scores, and read no masked V into P@V (0 * NaN).
                k_pos = tl.load(KPos + offs_n, mask=n_valid, other=0)
                k_blk = tl.load(KBlk + offs_n, mask=n_valid, other=-1)
                vis = _pair_mask(q_pos, q_blk, k_pos, k_blk, n_valid, window_left, CAUSAL, WINDOW)
                p, alpha, l_i, m_i = _softmax_step(tl.where(vis, s, float("-inf")), m_i, l_i)
                p = p.to(V.dtype.element_ty)  # P@V in the input dtype, as FlashAttention does
                if UPCAST:
                    p = p.to(tl.float32)
                acc = acc * alpha[:, None] + _dot_visible(p, vis, v, PREC)
            else:
                p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i)
                p = p.to(V.dtype.element_ty)
                if UPCAST:
                    p = p.to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
        k_tile = _next_candidate(KSearch, k_tile + 1, a, b, k_tile_end)

    empty = l_i == 0.0  # no visible key: out 0, lse -inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) / 1.4426950408889634)
    tl.store(Out + offs_m.to(tl.int64)[:, None] * q_stride + h * HEAD_DIM + offs_d[None, :], out.to(Out.dtype.element_ty), mask=m_valid[:, None] & d_ok[None, :])
    tl.store(Lse + offs_m.to(tl.int64) * num_heads + h, lse, mask=m_valid)


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
def _bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, QPos, KPos, QBlk, KBlk,
    CuQ, CuK, QTileSeq, QTileStart, QMeta, KTileOff, KMeta, KSearch,
    qk_scale, sm_scale, num_batch, num_heads, window_left,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, STEPS: tl.constexpr,
):
    q_tile = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(QTileSeq + q_tile)
    if seq >= num_batch:
        return
    kvh = h // GROUP
    q_start = tl.load(QTileStart + q_tile)
    q_end = tl.load(CuQ + seq + 1)
    k_seq_start = tl.load(CuK + seq)
    k_end = tl.load(CuK + seq + 1)
    k_tile_lo = tl.load(KTileOff + seq)
    k_tile_hi = tl.load(KTileOff + seq + 1)

    offs_m = q_start + tl.arange(0, BLOCK_M)
    m_valid = offs_m < q_end
    offs_d = tl.arange(0, BLOCK_D)  # head_dim padded to a power of two, masked
    d_ok = offs_d < HEAD_DIM
    q_stride = num_heads * HEAD_DIM
    kv_stride = (num_heads // GROUP) * HEAD_DIM
    q_off = offs_m.to(tl.int64)[:, None] * q_stride + h * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + q_off, mask=m_valid[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(DOut + q_off, mask=m_valid[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    row = offs_m.to(tl.int64) * num_heads + h
    lse = tl.load(Lse + row, mask=m_valid, other=float("inf")) * 1.4426950408889634
    lse = tl.where(lse == float("-inf"), float("inf"), lse)  # rows with no visible key: P = 0
    delta = tl.load(Delta + row, mask=m_valid, other=0.0)
    q_pos = tl.load(QPos + offs_m, mask=m_valid, other=0)
    q_blk = tl.load(QBlk + offs_m, mask=m_valid, other=-1)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Visit only the key tiles that can be visible: global ones and the block-overlap range.
    first, a, b, k_tile_end = _kv_candidates(QMeta, q_tile, KSearch, k_tile_lo, k_tile_hi, window_left, CAUSAL, WINDOW, STEPS)
    k_tile = _next_candidate(KSearch, first, a, b, k_tile_end)
    while k_tile < k_tile_end:
        any_vis, all_vis = _tiles_may_meet(QMeta, KMeta, q_tile, k_tile, window_left, CAUSAL, WINDOW)
        if any_vis:
            n_start = k_seq_start + (k_tile - k_tile_lo) * BLOCK_N
            offs_n = n_start + tl.arange(0, BLOCK_N)
            n_valid = offs_n < k_end
            kv_off = offs_n.to(tl.int64)[:, None] * kv_stride + kvh * HEAD_DIM + offs_d[None, :]
            k = tl.load(K + kv_off, mask=n_valid[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(V + kv_off, mask=n_valid[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            p = tl.math.exp2(s - lse[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            if (all_vis == 0) | (n_start + BLOCK_N > k_end):
                # Select (not multiply) so that a masked key's NaN in K or V stays out of dq.
                k_pos = tl.load(KPos + offs_n, mask=n_valid, other=0)
                k_blk = tl.load(KBlk + offs_n, mask=n_valid, other=-1)
                vis = _pair_mask(q_pos, q_blk, k_pos, k_blk, n_valid, window_left, CAUSAL, WINDOW)
                ds_lo = tl.where(vis, ds, 0.0).to(K.dtype.element_ty)
                if UPCAST:
                    ds_lo = ds_lo.to(tl.float32)
                dq += _dot_visible(ds_lo, vis, k, PREC)
            else:
                ds_lo = ds.to(K.dtype.element_ty)
                if UPCAST:
                    ds_lo = ds_lo.to(tl.float32)
                dq += tl.dot(ds_lo, k, input_precision=PREC)
        k_tile = _next_candidate(KSearch, k_tile + 1, a, b, k_tile_end)
    tl.store(DQ + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=m_valid[:, None] & d_ok[None, :])


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, QPos, KPos, QBlk, KBlk,
    CuQ, CuK, KTileSeq, KTileStart, KMeta, QTileOff, QMeta, QSearch,
    qk_scale, sm_scale, num_batch, num_heads, window_left,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, STEPS: tl.constexpr,
):
    k_tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(KTileSeq + k_tile)
    if seq >= num_batch:
        return
    k_start = tl.load(KTileStart + k_tile)
    k_end = tl.load(CuK + seq + 1)
    q_seq_start = tl.load(CuQ + seq)
    q_end = tl.load(CuQ + seq + 1)
    q_tile_lo = tl.load(QTileOff + seq)
    q_tile_hi = tl.load(QTileOff + seq + 1)

    offs_n = k_start + tl.arange(0, BLOCK_N)
    n_valid = offs_n < k_end
    offs_d = tl.arange(0, BLOCK_D)  # head_dim padded to a power of two, masked
    d_ok = offs_d < HEAD_DIM
    q_stride = num_heads * HEAD_DIM
    kv_stride = (num_heads // GROUP) * HEAD_DIM
    kv_off = offs_n.to(tl.int64)[:, None] * kv_stride + kvh * HEAD_DIM + offs_d[None, :]
    k = tl.load(K + kv_off, mask=n_valid[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(V + kv_off, mask=n_valid[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    k_pos = tl.load(KPos + offs_n, mask=n_valid, other=0)
    k_blk = tl.load(KBlk + offs_n, mask=n_valid, other=-1)
    k_partial = k_start + BLOCK_N > k_end

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Only global query tiles from q_first on and the block-overlap range [a, b) can see this tile.
    q_first, a, b, q_stop = _q_candidates(KMeta, k_tile, QSearch, q_tile_lo, q_tile_hi, window_left, CAUSAL, WINDOW, STEPS)
    for g in range(GROUP):  # the query heads sharing this kv head
        h = kvh * GROUP + g
        q_tile = _next_candidate(QSearch, q_first, a, b, q_stop)
        while q_tile < q_stop:
            any_vis, all_vis = _tiles_may_meet(QMeta, KMeta, q_tile, k_tile, window_left, CAUSAL, WINDOW)
            if any_vis:
                offs_m = q_seq_start + (q_tile - q_tile_lo) * BLOCK_M + tl.arange(0, BLOCK_M)
                m_valid = offs_m < q_end
                q_off = offs_m.to(tl.int64)[:, None] * q_stride + h * HEAD_DIM + offs_d[None, :]
                q = tl.load(Q + q_off, mask=m_valid[:, None] & d_ok[None, :], other=0.0)
                do = tl.load(DOut + q_off, mask=m_valid[:, None] & d_ok[None, :], other=0.0)
                if UPCAST:
                    q = q.to(tl.float32)
                    do = do.to(tl.float32)
                row = offs_m.to(tl.int64) * num_heads + h
                lse = tl.load(Lse + row, mask=m_valid, other=float("inf")) * 1.4426950408889634
                lse = tl.where(lse == float("-inf"), float("inf"), lse)
                delta = tl.load(Delta + row, mask=m_valid, other=0.0)
                # Transposed scores [BLOCK_N, BLOCK_M] so that dk, dv come out of plain dots.
                s_t = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale
                p_t = tl.math.exp2(s_t - lse[None, :])
                dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
                ds_t = p_t * (dp_t - delta[None, :])
                if (all_vis == 0) | k_partial:
                    # Select (not multiply): nothing of a query that cannot see a key reaches it.
                    q_pos = tl.load(QPos + offs_m, mask=m_valid, other=0)
                    q_blk = tl.load(QBlk + offs_m, mask=m_valid, other=-1)
                    vis = tl.trans(_pair_mask(q_pos, q_blk, k_pos, k_blk, n_valid, window_left, CAUSAL, WINDOW))
                    p_lo = tl.where(vis, p_t, 0.0).to(Q.dtype.element_ty)
                    ds_lo = tl.where(vis, ds_t, 0.0).to(Q.dtype.element_ty)
                    if UPCAST:
                        p_lo = p_lo.to(tl.float32)
                        ds_lo = ds_lo.to(tl.float32)
                    dv += _dot_visible(p_lo, vis, do, PREC)
                    dk += _dot_visible(ds_lo, vis, q, PREC)
                else:
                    p_lo = p_t.to(Q.dtype.element_ty)
                    ds_lo = ds_t.to(Q.dtype.element_ty)
                    if UPCAST:
                        p_lo = p_lo.to(tl.float32)
                        ds_lo = ds_lo.to(tl.float32)
                    dv += tl.dot(p_lo, do, input_precision=PREC)
                    dk += tl.dot(ds_lo, q, input_precision=PREC)
            q_tile = _next_candidate(QSearch, q_tile + 1, a, b, q_stop)
    tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=n_valid[:, None] & d_ok[None, :])
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=n_valid[:, None] & d_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Launch helpers
# ----------------------------------------------------------------------------------------------
def _defaults(cu, pos, blk, total):
    """int32 offsets, positions (default: arange per sequence) and blocks (default: -1).

    Engines pass int64 as often as int32; the kernels read int32 (values fit: validated)."""
    if pos is None:
        idx = torch.arange(total, device=cu.device)
        seq = torch.searchsorted(cu[1:].long(), idx, right=True)
        pos = (idx - cu.long()[seq]).int()
    if blk is None:
        blk = torch.full((total,), -1, dtype=torch.int32, device=cu.device)
    return cu.int(), pos.int(), blk.int()


# A model calls the op once per layer with the same index tensors: keep the last few tile plans.
# Entries hold strong references, so an `is` match cannot be a recycled tensor, and the version
# counters catch in-place edits. Inference tensors have no version counter (an in-place edit
# would go unseen), so their plans are never cached.
_PLAN_CACHE: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_PLAN_CACHE_SIZE = 8


def _tile_plan(cu, pos, blk, total, block):
    """(cu, pos, blk, tile_off, tile_seq, tile_start, meta, search) for one side (int32), cached
    per call site."""
    if any(t is not None and t.is_inference() for t in (cu, pos, blk)):
        full = _defaults(cu, pos, blk, total)
        return full + tile_metadata(*full, total, block)
    key = (id(cu), id(pos), id(blk), total, block)
    hit = _PLAN_CACHE.get(key)
    versions = tuple(-1 if t is None else t._version for t in (cu, pos, blk))
    if hit is not None and hit[0] is cu and hit[1] is pos and hit[2] is blk and hit[3] == versions:
        _PLAN_CACHE.move_to_end(key)
        return hit[4]
    full = _defaults(cu, pos, blk, total)
    plan = full + tile_metadata(*full, total, block)
    _PLAN_CACHE[key] = (cu, pos, blk, versions, plan)
    while len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
        _PLAN_CACHE.popitem(last=False)
    return plan


MAX_HEAD_DIM = 256


def block_d(head_dim: int) -> int:
    """The head dim padded to a power of two (at least 16, tl.dot's minimum); the padding is masked."""
    return max(16, triton.next_power_of_2(head_dim))


def _config(head_dim: int, backward: bool):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the padded head dim. The interpreter wants
    few, big tiles."""
    head_dim = block_d(head_dim)
    if _INTERPRET:
        return 32, 32, 4, 1
    if backward:
        return (64, 64, 4, 2) if head_dim <= 128 else (32, 32, 4, 1)
    if head_dim <= 64:
        return 128, 64, 4, 3
    if head_dim <= 128:
        return 128, 64, 8, 3
    return 64, 32, 8, 2


def _steps(num_tiles: int) -> int:
    """Binary-search steps covering num_tiles (a power of two, to bound recompilations)."""
    return max(1, int(num_tiles).bit_length() + 1)


def _prec(q):
    return "ieee" if (q.dtype == torch.float32 or _INTERPRET) else "tf32"


def varlen_attention_fwd(q, k, v, cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, causal, scale, window_left=-1, *,
                         block_m=None, block_n=None, out=None, lse=None):
    """Forward launcher: ``(out [total_q, H, D] like q, lse float32 [total_q, H])``. Inputs contiguous;
    ``out``/``lse`` (optional) are contiguous preallocated outputs, written in place."""
    total_q, num_heads, head_dim = q.shape
    total_k, num_kv_heads, _ = k.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    bm, bn, warps, stages = _config(head_dim, backward=False)
    bm, bn = block_m or bm, block_n or bn
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(total_q, num_heads, dtype=torch.float32, device=q.device) if lse is None else lse
    batch = cu_q.numel() - 1
    if total_q == 0 or batch == 0:
        return out, lse
    cu_q, q_pos, q_block, q_off, q_seq, q_start, q_meta, _ = _tile_plan(cu_q, q_pos, q_block, total_q, bm)
    cu_k, kv_pos, kv_block, k_off, k_seq, _, k_meta, k_search = _tile_plan(cu_k, kv_pos, kv_block, total_k, bn)
    grid = (q_seq.numel(), num_heads)
    _fwd_kernel[grid](
        q, k, v, out, lse, q_pos, kv_pos, q_block, kv_block,
        cu_q, cu_k, q_seq, q_start, q_meta, k_off, k_meta, k_search,
        scale * _LOG2E, batch, num_heads, max(int(window_left), 0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=bm, BLOCK_N=bn,
        CAUSAL=bool(causal), WINDOW=window_left >= 0, UPCAST=_INTERPRET, PREC=_prec(q), STEPS=_steps(k_seq.numel()),
        num_warps=warps, num_stages=stages,
    )
    return out, lse


def varlen_attention_bwd(dout, q, k, v, out, lse, cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, causal, scale,
                         window_left=-1, *, block_m=None, block_n=None):
    """Backward launcher: ``(dq, dk, dv)`` in the inputs' dtypes. Inputs contiguous."""
    total_q, num_heads, head_dim = q.shape
    total_k, num_kv_heads, _ = k.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    bm, bn, warps, stages = _config(head_dim, backward=True)
    bm, bn = block_m or bm, block_n or bn
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    batch = cu_q.numel() - 1
    if batch == 0 or (total_q == 0 and total_k == 0):
        return dq.zero_(), dk.zero_(), dv.zero_()
    cu_q, q_pos, q_block, q_off, q_seq, q_start, q_meta, q_search = _tile_plan(cu_q, q_pos, q_block, total_q, bm)
    cu_k, kv_pos, kv_block, k_off, k_seq, k_start, k_meta, k_search = _tile_plan(cu_k, kv_pos, kv_block, total_k, bn)

    delta = torch.empty(total_q, num_heads, dtype=torch.float32, device=q.device)
    rows = total_q * num_heads
    if rows:
        pre_block = 64
        _bwd_preprocess[(triton.cdiv(rows, pre_block),)](out, dout, delta, rows, HEAD_DIM=head_dim,
                                                          BLOCK_D=block_d(head_dim), BLOCK=pre_block)
    common = dict(
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=bm, BLOCK_N=bn,
        CAUSAL=bool(causal), WINDOW=window_left >= 0, UPCAST=_INTERPRET, PREC=_prec(q),
        STEPS=_steps(max(q_seq.numel(), k_seq.numel())),
        num_warps=warps, num_stages=stages,
    )
    if q_seq.numel():
        _bwd_dq_kernel[(q_seq.numel(), num_heads)](
            q, k, v, dout, lse, delta, dq, q_pos, kv_pos, q_block, kv_block,
            cu_q, cu_k, q_seq, q_start, q_meta, k_off, k_meta, k_search,
            scale * _LOG2E, scale, batch, num_heads, max(int(window_left), 0), **common,
        )
    if k_seq.numel():
        _bwd_dkdv_kernel[(k_seq.numel(), num_kv_heads)](
            q, k, v, dout, lse, delta, dk, dv, q_pos, kv_pos, q_block, kv_block,
            cu_q, cu_k, k_seq, k_start, k_meta, q_off, q_meta, q_search,
            scale * _LOG2E, scale, batch, num_heads, max(int(window_left), 0), **common,
        )
    return dq, dk, dv
