"""Triton kernels of ``ragattn.varlen_attention``: packed attention with a position/block mask.

Query ``i`` sees key ``j`` of the same sequence iff ``(not causal or kv_pos[j] <= q_pos[i])`` and
``(q_block[i] == kv_block[j] or q_block[i] == -1 or kv_block[j] == -1)`` and
``(window_left < 0 or kv_pos[j] >= q_pos[i] - window_left)``.

Masked keys are never read into a sum: in partially visible tile pairs the scores are selected
(``where``), not multiplied by a 0/1 mask, and the second dot of each pair (P@V, dS@K, P^T@dO,
dS^T@Q) zeroes non-finite operands first (``_dot_finite``), because 0 * NaN is NaN; the forward
puts NaN back where a visible value was non-finite (``_dot_visible``: the per-element
rule; gradients are specified for finite visible inputs only). Fully visible tile pairs take the
fast path without any mask.

The mask is never materialised. A plan (``VarlenPlan``, planned on the host by ``varlen_plan.py``
once per index tensors, cached) summarises each query and key tile by five numbers (min/max position, min/max
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

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from ragattn.triton_kernels.merge_attention_states import merge_split_states
from ragattn.triton_kernels.gpu_configs import DEFAULT, device_name as _device_name, dtype_class, get_config
from ragattn.triton_kernels.plan_cache import IndexPlanCache
from ragattn.triton_kernels.soft_cap import soft_cap_grad, soft_cap_log2
from ragattn.triton_kernels.varlen_plan import Csr, VarlenPlan, build_plan

# The interpreter's tl.dot on bf16 is wrong: upcast the operands to fp32 there (and only there).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_LOG2E = 1.4426950408889634


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
def _head_dims(num_heads, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """(offs_d, d_ok, q_stride, kv_stride): the head dims (padded to BLOCK_D, the padding masked) and
    the row strides of q/out ``[rows, num_heads, HEAD_DIM]`` and k/v ``[rows, num_heads // GROUP, HEAD_DIM]``."""
    offs_d = tl.arange(0, BLOCK_D)
    return offs_d, offs_d < HEAD_DIM, num_heads * HEAD_DIM, (num_heads // GROUP) * HEAD_DIM


@triton.jit
def _tile_rows(start, end, BLOCK: tl.constexpr):
    """(rows, valid) of the tile of BLOCK rows from ``start`` in a sequence ending at ``end``."""
    offs = start + tl.arange(0, BLOCK)
    return offs, offs < end


@triton.jit
def _scores(a, b, qk_scale, softcap_log2, SOFTCAP: tl.constexpr, PREC: tl.constexpr):
    """``a @ b^T`` scaled to the log2 domain (and soft-capped): the scores of a tile pair."""
    x = tl.dot(a, tl.trans(b), input_precision=PREC) * qk_scale
    if SOFTCAP:
        x = soft_cap_log2(x, softcap_log2)
    return x


@triton.jit
def _probs_grads(x, lse, d_p, delta, softcap_log2, SOFTCAP: tl.constexpr):
    """The backward's (P, dS) of a tile from its scores ``x`` (log2 domain), the rows' base-2
    ``lse`` and ``delta`` broadcast to ``x``'s shape, and ``d_p`` = dO @ V^T: P = 2^(x - lse),
    dS = P * (dP - delta), times the soft cap's derivative."""
    p = tl.math.exp2(x - lse)
    ds = p * (d_p - delta)
    if SOFTCAP:
        ds = ds * soft_cap_grad(x, softcap_log2)
    return p, ds


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
    qk_scale, num_heads, window_left, softcap_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    KDesc=None, VDesc=None, USE_TMA: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    MASKED_SUB: tl.constexpr = 1,  # the masked loop takes a key tile in this many slices
):
    h = tl.program_id(0)  # heads vary fastest: the longest work item's heads launch first
    item = _item()
    q_start, q_end, k_end, e_start, e_mid, e_end, dest = _work_item(Work, item)
    kvh = h // GROUP
    offs_d, d_ok, q_stride, kv_stride = _head_dims(num_heads, GROUP, HEAD_DIM, BLOCK_D)
    offs_m, m_valid = _tile_rows(q_start, q_end, BLOCK_M)
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
        s = _scores(q, k, qk_scale, softcap_log2, SOFTCAP, PREC)
        p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(_low(p, V, UPCAST), v, input_precision=PREC)

    # Partially visible key tiles: mask the scores, and read no masked V into P@V (0 * NaN).
    q_pos = tl.load(QPos + offs_m, mask=m_valid, other=0)
    q_lo = _window_start(q_pos, window_left)
    q_blk = tl.load(QBlk + offs_m, mask=m_valid, other=-1)
    # A masked tile in MASKED_SUB slices of its keys, one after another: the NaN guards hold registers
    # per key, so a wide tile (the mask-free loop's) stays spill-free here.
    SUB_N: tl.constexpr = BLOCK_N // MASKED_SUB
    for e in range(e_mid, e_end):
        row0 = tl.load(KvRows + e)
        for sub in tl.static_range(MASKED_SUB):
            offs_n = row0 + sub * SUB_N + tl.arange(0, SUB_N)
            n_valid = offs_n < k_end
            k, v, k_pos, k_blk = _key_tile(K, V, KPos, KBlk, offs_n, n_valid, kvh * HEAD_DIM, offs_d, d_ok, kv_stride,
                                           UPCAST)
            s = _scores(q, k, qk_scale, softcap_log2, SOFTCAP, PREC)
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
def _query_tile(Q, DOut, Lse, Delta, start, end, h, offs_d, d_ok, q_stride, num_heads, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr, UPCAST: tl.constexpr):
    """What the backward reads of a query tile for head ``h``: (rows, valid, q, dO, base-2 lse, delta)."""
    offs_m, m_valid = _tile_rows(start, end, BLOCK_M)
    q = _load_rows(Q, offs_m, m_valid, h * HEAD_DIM, offs_d, d_ok, q_stride, UPCAST)
    do = _load_rows(DOut, offs_m, m_valid, h * HEAD_DIM, offs_d, d_ok, q_stride, UPCAST)
    lse, delta = _row_stats(Lse, Delta, offs_m, m_valid, h, num_heads)
    return offs_m, m_valid, q, do, lse, delta


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, QPos, KPos, QBlk, KBlk, Work, KvRows,
    qk_scale, sm_scale, num_heads, window_left, softcap_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, SOFTCAP: tl.constexpr,
):
    h = tl.program_id(0)
    item = _item()
    q_start, q_end, k_end, e_start, e_mid, e_end, dest = _work_item(Work, item)
    kvh = h // GROUP
    offs_d, d_ok, q_stride, kv_stride = _head_dims(num_heads, GROUP, HEAD_DIM, BLOCK_D)
    offs_m, m_valid, q, do, lse, delta = _query_tile(Q, DOut, Lse, Delta, q_start, q_end, h, offs_d, d_ok, q_stride,
                                                     num_heads, HEAD_DIM, BLOCK_M, UPCAST)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    all_rows = tl.full([BLOCK_N], 1, tl.int1)

    for e in range(e_start, e_mid):  # key tiles visible in full
        offs_n = tl.load(KvRows + e) + tl.arange(0, BLOCK_N)
        k = _load_rows(K, offs_n, all_rows, kvh * HEAD_DIM, offs_d, d_ok, kv_stride, UPCAST)
        v = _load_rows(V, offs_n, all_rows, kvh * HEAD_DIM, offs_d, d_ok, kv_stride, UPCAST)
        x = _scores(q, k, qk_scale, softcap_log2, SOFTCAP, PREC)
        p, ds = _probs_grads(x, lse[:, None], tl.dot(do, tl.trans(v), input_precision=PREC), delta[:, None],
                             softcap_log2, SOFTCAP)
        dq += tl.dot(_low(ds, K, UPCAST), k, input_precision=PREC)

    q_pos = tl.load(QPos + offs_m, mask=m_valid, other=0)
    q_lo = _window_start(q_pos, window_left)
    q_blk = tl.load(QBlk + offs_m, mask=m_valid, other=-1)
    for e in range(e_mid, e_end):  # partially visible: select, so a masked key's NaN stays out of dq
        offs_n = tl.load(KvRows + e) + tl.arange(0, BLOCK_N)
        n_valid = offs_n < k_end
        k, v, k_pos, k_blk = _key_tile(K, V, KPos, KBlk, offs_n, n_valid, kvh * HEAD_DIM, offs_d, d_ok, kv_stride,
                                       UPCAST)
        x = _scores(q, k, qk_scale, softcap_log2, SOFTCAP, PREC)
        p, ds = _probs_grads(x, lse[:, None], tl.dot(do, tl.trans(v), input_precision=PREC), delta[:, None],
                             softcap_log2, SOFTCAP)
        vis = _pair_mask(q_pos, q_lo, q_blk, k_pos, k_blk, n_valid, CAUSAL, WINDOW)
        dq = _dot_finite(dq, _low(tl.where(vis, ds, 0.0), K, UPCAST), k, PREC)
    tl.store(DQ + offs_m.to(tl.int64)[:, None] * q_stride + h * HEAD_DIM + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=m_valid[:, None] & d_ok[None, :])


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, QPos, KPos, QBlk, KBlk, Work, QRows,
    qk_scale, sm_scale, num_heads, window_left, softcap_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, SOFTCAP: tl.constexpr,
):
    kvh = tl.program_id(0)
    item = _item()
    k_start, k_end, q_end, e_start, e_mid, e_end, dest = _work_item(Work, item)

    offs_d, d_ok, q_stride, kv_stride = _head_dims(num_heads, GROUP, HEAD_DIM, BLOCK_D)
    offs_n, n_valid = _tile_rows(k_start, k_end, BLOCK_N)
    k, v, k_pos, k_blk = _key_tile(K, V, KPos, KBlk, offs_n, n_valid, kvh * HEAD_DIM, offs_d, d_ok, kv_stride, UPCAST)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(GROUP):  # the query heads sharing this kv head
        h = kvh * GROUP + g
        for e in range(e_start, e_mid):  # query tiles that see this (full-length) key tile in full
            offs_m, m_valid, q, do, lse, delta = _query_tile(Q, DOut, Lse, Delta, tl.load(QRows + e), q_end, h, offs_d,
                                                             d_ok, q_stride, num_heads, HEAD_DIM, BLOCK_M, UPCAST)
            # Transposed scores [BLOCK_N, BLOCK_M] so that dk, dv come out of plain dots.
            x_t = _scores(k, q, qk_scale, softcap_log2, SOFTCAP, PREC)
            p_t, ds_t = _probs_grads(x_t, lse[None, :], tl.dot(v, tl.trans(do), input_precision=PREC), delta[None, :],
                                     softcap_log2, SOFTCAP)
            dv += tl.dot(_low(p_t, Q, UPCAST), do, input_precision=PREC)
            dk += tl.dot(_low(ds_t, Q, UPCAST), q, input_precision=PREC)
        for e in range(e_mid, e_end):  # partially: nothing of a query that cannot see a key reaches it
            offs_m, m_valid, q, do, lse, delta = _query_tile(Q, DOut, Lse, Delta, tl.load(QRows + e), q_end, h, offs_d,
                                                             d_ok, q_stride, num_heads, HEAD_DIM, BLOCK_M, UPCAST)
            q_pos = tl.load(QPos + offs_m, mask=m_valid, other=0)
            q_lo = _window_start(q_pos, window_left)
            q_blk = tl.load(QBlk + offs_m, mask=m_valid, other=-1)
            x_t = _scores(k, q, qk_scale, softcap_log2, SOFTCAP, PREC)
            p_t, ds_t = _probs_grads(x_t, lse[None, :], tl.dot(v, tl.trans(do), input_precision=PREC), delta[None, :],
                                     softcap_log2, SOFTCAP)
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
# A model calls the op once per layer with the same index tensors: keep the last few plans (the
# hit rules are those of ragattn.triton_kernels.plan_cache: same objects and versions, or equal contents).
_PLAN_CACHE = IndexPlanCache(8)


def _cached_plan(index, total_q, total_k, **params) -> VarlenPlan:
    """``build_plan`` for ``index`` = (cu_q, cu_k, q_pos, kv_pos, q_block, kv_block), cached."""
    key = (total_q, total_k, tuple(sorted(params.items())))
    return _PLAN_CACHE.get(index, key, lambda: build_plan(*index, total_q, total_k, **params))


MAX_HEAD_DIM = 256


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
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of ``kernel`` ("fwd", "dq" or "dkdv") on ``device_name``
    (None: the heuristic default) from ``configs/varlen_attention.json``. The defaults are spill-free
    for sm_90 (``python -m ragattn.bench.sm90``): the masked loops' NaN guards bound the tiles, a window's
    compare halves the 16-bit forward's key tile at d > 64. The interpreter wants few, big tiles."""
    c = get_config("varlen_attention", None if _INTERPRET else (device_name or DEFAULT),
                   config_key(head_dim, kernel, dtype, window))
    return c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"]


def masked_slices(block_n: int, wanted: int) -> int:
    """The forward's MASKED_SUB: the config's ``masked_sub`` (a power of two; default 1) cut so that
    each slice keeps at least 16 keys (tl.dot's minimum)."""
    wanted = max(1, int(wanted))
    if wanted & (wanted - 1):
        raise ValueError(f"varlen_attention config: masked_sub must be a power of two, got {wanted}")
    return max(1, min(wanted, block_n // 16))


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


def _problem(q, k, scale, window_left):
    """(total_q, total_k, num_heads, num_kv_heads, head_dim, scale, window) of a launch: the softmax
    scale defaults to 1/sqrt(head_dim), ``window`` is -1 without a sliding window."""
    total_q, num_heads, head_dim = q.shape
    total_k, num_kv_heads, _ = k.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    window = int(window_left) if window_left is not None and window_left >= 0 else -1
    return total_q, total_k, num_heads, num_kv_heads, head_dim, scale, window


def varlen_attention_fwd(q, k, v, cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, causal, scale, window_left=-1, *,
                         block_m=None, block_n=None, split_len=None, out=None, lse=None, logits_soft_cap=0.0):
    """Forward launcher: ``(out [total_q, H, D] like q, lse float32 [total_q, H])``. Inputs contiguous;
    ``out``/``lse`` (optional) are contiguous preallocated outputs, written in place. ``split_len``
    (tests): split query tiles that see more than that many key tiles (default: by SM count)."""
    total_q, total_k, num_heads, num_kv_heads, head_dim, scale, window = _problem(q, k, scale, window_left)
    dev_name = _device_name(q.device)
    bm, bn, warps, stages = _config(head_dim, "fwd", q.dtype, window >= 0, dev_name)
    opts = get_config("varlen_attention", None if _INTERPRET else (dev_name or DEFAULT),
                      config_key(head_dim, "fwd", q.dtype, window >= 0))
    tma = bool(opts.get("tma", False)) and not _INTERPRET
    bm, bn = block_m or bm, block_n or bn
    masked_sub = masked_slices(bn, opts.get("masked_sub", 1))
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
            scale * _LOG2E, num_heads, max(window, 0), logits_soft_cap * _LOG2E,
            GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=bm, BLOCK_N=bn,
            CAUSAL=bool(causal), WINDOW=window >= 0, UPCAST=_INTERPRET, PREC=_prec(q), SOFTCAP=logits_soft_cap > 0,
            num_warps=warps, num_stages=stages, KDesc=k_desc, VDesc=v_desc, USE_TMA=k_desc is not None,
            MASKED_SUB=masked_sub,
        )
    if parts_rows:  # merge the splits of long rows, then put their valid rows in place
        merged = torch.empty(parts_rows, num_heads, head_dim, dtype=out.dtype, device=q.device)
        merged_lse = torch.empty(parts_rows, num_heads, dtype=torch.float32, device=q.device)
        merge_split_states(parts, parts_lse, merged, merged_lse)
        out.index_copy_(0, csr.split_rows, merged.index_select(0, csr.split_local))
        lse.index_copy_(0, csr.split_rows, merged_lse.index_select(0, csr.split_local))
    return out, lse


def varlen_attention_bwd(dout, q, k, v, out, lse, cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, causal, scale,
                         window_left=-1, *, block_m=None, block_n=None, logits_soft_cap=0.0):
    """Backward launcher: ``(dq, dk, dv)`` in the inputs' dtypes. Inputs contiguous."""
    total_q, total_k, num_heads, num_kv_heads, head_dim, scale, window = _problem(q, k, scale, window_left)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if cu_q.numel() <= 1 or (total_q == 0 and total_k == 0):
        return dq.zero_(), dk.zero_(), dv.zero_()
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
                      SOFTCAP=logits_soft_cap > 0, num_warps=warps, num_stages=stages)
        if kernel == "dq" and plan.by_q.items:
            grid, work = _launch(num_heads, plan.by_q)
            _bwd_dq_kernel[grid](
                q, k, v, dout, lse, delta, dq, *args, work, plan.by_q.rows,
                scale * _LOG2E, scale, num_heads, max(window, 0), logits_soft_cap * _LOG2E, **common,
            )
        if kernel == "dkdv" and plan.by_k.items:
            grid, work = _launch(num_kv_heads, plan.by_k)
            _bwd_dkdv_kernel[grid](
                q, k, v, dout, lse, delta, dk, dv, *args, work, plan.by_k.rows,
                scale * _LOG2E, scale, num_heads, max(window, 0), logits_soft_cap * _LOG2E, **common,
            )
    return dq, dk, dv
