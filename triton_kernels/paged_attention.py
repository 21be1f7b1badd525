"""Q-indexed attention over a paged KV cache: sparse prefill, speculative tails and decode.

One kernel serves every case. A program owns one *query tile* of one sequence (up to BLOCK_M
consecutive query rows of that sequence) for one KV head, and stacks the rows x the GQA group of
query heads that read that KV head into the rows of its tile, so ``tl.dot`` sees
``M = BLOCK_M * GROUP_PAD`` rows while each K/V tile is loaded once for the whole group::

    tile rows:  (row0, h0) (row0, h1) .. (row0, hG-1) (row1, h0) ..      <- M = BLOCK_M * GROUP_PAD
    key tiles:  [0, BLOCK_N) [BLOCK_N, 2 BLOCK_N) ..  up to min(kv_len, max q_pos of the tile + 1)

Row ``i`` sees slot ``j`` iff ``j < kv_len`` and ``j <= q_pos[i]`` and, with a sliding window,
``j >= q_pos[i] - window_left``; key tiles right of the tile's largest position or left of its
smallest window start are never visited, so work is proportional to the visible keys.

Masked slots are never read into a row. Key tiles that every row of the query tile sees whole
run in a loop of their own with no masks (``_attend_key_tiles``, TILES=0), where V feeds only the
P @ V product and so is pipelined like K; partially masked tiles (the causal diagonal, the window
edge, the last tile; every tile of a position-tagged table) run before and after it, zeroing
non-finite V values before the P @ V product and putting NaN back only where a row sees them (an
extra visible-mask @ non-finite-mask product, in those tiles only)::

    keys of a split:  [lo ............ f0) [f0 .................. f1) [f1 .... hi)
                       masked (window edge)  whole tiles, no masks       masked (diagonal, last)

That split is for decode and verify tiles (up to 64 stacked rows); prefill's 128-row tiles test
each tile in one loop (TILES=2), where three loops would spill. A NaN or +inf
visible score poisons its row (out and lse NaN); a -inf one has weight 0. Slot ``j`` is
read from page ``block_table[b, j // page_size]`` at offset ``j % page_size`` (any page size, pages
in any order). Key tiles start at multiples of BLOCK_N, so with a power-of-two page size a tile
reads its page ids once per page (or once, when it lies inside one page), not once per slot
(docs/perf/). The softmax is the online (FlashAttention) one in base
2 with fp32 statistics.

Split-KV (few query rows against long contexts, e.g. decode): a third grid axis cuts each tile's
key range (from its first visible key tile) into ``num_splits`` pieces of ``split_len`` slots; each
program writes its normalised partial output and LSE in fp32, and ``merge_split_states`` reduces
them exactly. Tiles, warps, stages and the split target come from ``configs/paged_attention.json``
(``kernel_config``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .merge_attention_states import merge_split_states
from .paged_plan import PagedPlan, interpreting, page_mode, plan_paged_attention, split_whole_tiles  # noqa: F401
from .soft_cap import soft_cap_log2

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _per_slot(ptr, start, hi, j, page_size, PAGE_MODE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The per-page value ``ptr[p]`` (a page id, an entry's position or length) of each slot ``j`` of
    the key tile ``[start, start + BLOCK_N)``, 0 for slots at or past ``hi``: read once per slot
    (mode 0), once per page (1: PAGE_SIZE divides BLOCK_N, ``start`` a multiple of BLOCK_N) or once
    for the tile (2: the tile lies inside one page)."""
    if PAGE_MODE == 2:
        return tl.zeros([BLOCK_N], tl.int32) + tl.load(ptr + start // PAGE_SIZE)
    elif PAGE_MODE == 1:
        NP: tl.constexpr = BLOCK_N // PAGE_SIZE
        p = start // PAGE_SIZE + tl.arange(0, NP)
        per_page = tl.load(ptr + p, mask=p * PAGE_SIZE < hi, other=0)
        return tl.reshape(tl.broadcast_to(per_page[:, None], (NP, PAGE_SIZE)), (BLOCK_N,))
    else:
        return tl.load(ptr + j // page_size, mask=j < hi, other=0)


@triton.jit
def _pv_whole(acc, p, v, IEEE_FP32: tl.constexpr):
    """acc + P @ V for a tile every row sees whole: non-finite V reaches exactly the rows it should."""
    if IEEE_FP32:
        return acc + tl.dot(p, v, input_precision="ieee")
    return acc + tl.dot(p.to(v.dtype), v)


@triton.jit
def _pv_masked(acc, p, v, visible, IEEE_FP32: tl.constexpr):
    """acc + P @ V for a partially masked tile: a masked slot must not reach a row through 0 * NaN,
    so non-finite V values are zeroed and put back as NaN only where a row sees them."""
    v_bad = (v != v) | (tl.abs(v) == float("inf"))
    v = tl.where(v_bad, 0.0, v)
    if IEEE_FP32:
        acc += tl.dot(p, v, input_precision="ieee")
        hits = tl.dot(visible.to(tl.float32), v_bad.to(tl.float32), input_precision="ieee")
    else:
        acc += tl.dot(p.to(v.dtype), v)
        hits = tl.dot(visible.to(v.dtype), v_bad.to(v.dtype))
    return tl.where(hits > 0, float("nan"), acc)


@triton.jit
def _rope_angle(pos, turn_hi, turn_lo):
    """``[N, D]`` fp32 angles ``pos * freq`` reduced to ``[0, 2 pi)``, from int64 positions ``pos [N]``
    and each frequency in turns as a 64-bit fixed-point fraction ``turn_hi [D]``, ``turn_lo [D]``
    (uint32 halves): the fraction of ``pos * turns`` is bits 32..63 of that product mod 2^64, which
    32-bit multiplies give exactly (``umulhi`` for the low half, ``pos >> 32`` for positions past
    2^32). An fp64 angle reduced by floor(ang / 2 pi) is as accurate but holds 64-bit values per
    key element, which spill at decode's key tiles; this holds 32-bit ones."""
    p_lo = pos.to(tl.uint32)  # pos mod 2^32
    p_hi = (pos >> 32).to(tl.uint32)
    frac = p_lo[:, None] * turn_hi[None, :] + tl.umulhi(p_lo[:, None], turn_lo[None, :]) + p_hi[:, None] * turn_lo[None, :]
    return frac.to(tl.float32) * 1.4629180792671596e-09  # 2 pi / 2^32


@triton.jit
def _nan_where_seen(acc, visible, v_bad, IEEE_FP32: tl.constexpr):
    """``acc`` with NaN wherever a row sees a non-finite V value (``v_bad``, zeroed for the P @ V dot)."""
    if IEEE_FP32:
        hits = tl.dot(visible.to(tl.float32), v_bad.to(tl.float32), input_precision="ieee")
    else:
        hits = tl.dot(visible.to(tl.float16), v_bad.to(tl.float16))
    return tl.where(hits > 0, float("nan"), acc)


@triton.jit
def _attend_key_tiles(
    m_i, l_i, acc, bad_row, lo, hi, skip_at, skip_len, slot_end,
    q, q_pos, row_ok, row_lo, row_hi, d, d_ok, Q, K_CACHE, V_CACHE, page_row, ENTRY_POS, ENTRY_LEN, ENTRY_START,
    entry0,
    kv_head, stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, page_size,
    k_scale, v_scale, rot, partner, turn_hi, turn_lo, sgn, qk_scale, softcap_log2, window_left, full_lo, full_hi,
    TILES: tl.constexpr,  # 0: every row sees every slot of [lo, hi); 1: masked tiles; 2: decided per tile
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
    IEEE_FP32: tl.constexpr, POS_TABLE: tl.constexpr, HAS_ENTRY_LEN: tl.constexpr, HAS_ENTRY_START: tl.constexpr,
    ROPE: tl.constexpr,
    KV_FP8: tl.constexpr, PAGE_MODE: tl.constexpr, PAGE_SIZE: tl.constexpr, FAST_TRIG: tl.constexpr,
    PIPELINE_V: tl.constexpr,
):
    """The online softmax over the key tiles ``[lo, hi)`` (steps of BLOCK_N) of one query tile;
    returns the updated ``(m_i, l_i, acc, bad_row)``. ``TILES=0`` is the lean loop of key tiles that
    every row sees whole: no visibility masks and V used by the P @ V product alone, so Triton
    pipelines its loads as it does K's (the static sm_90 report showed V as a plain register load
    while the masked code shared the loop). ``TILES=2`` (prefill's 128-row tiles, where three loops
    would spill) tests each tile for being whole (``[full_lo, full_hi]``) at run time; with
    ``PIPELINE_V`` its V load is used outside that test (the NaN fix-up masked by it), so Triton
    pipelines V as K (the static sm_90 report showed V as a plain load in this loop). The loop walks
    ``[lo, hi)`` with the tiles from ``skip_at`` on moved ``skip_len`` slots right (one masked loop
    over both edges of a window split, ``EDGE_LOOP``; 0 elsewhere); ``slot_end``: the split's end."""
    for vstart in range(lo, hi, BLOCK_N):
        start = vstart + (vstart >= skip_at).to(tl.int32) * skip_len
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < slot_end
        page = _per_slot(page_row, start, slot_end, j, page_size, PAGE_MODE, PAGE_SIZE, BLOCK_N).to(tl.int64)
        if PAGE_MODE > 0:
            off = j % PAGE_SIZE
        else:
            off = j % page_size
        slot_ok = j_ok
        if HAS_ENTRY_LEN:
            slot_ok = slot_ok & (off < _per_slot(ENTRY_LEN + entry0, start, slot_end, j, page_size, PAGE_MODE,
                                                 PAGE_SIZE, BLOCK_N))
        if HAS_ENTRY_START:   # an entry that is a run of its page: slots below its start are not its own
            slot_ok = slot_ok & (off >= _per_slot(ENTRY_START + entry0, start, slot_end, j, page_size, PAGE_MODE,
                                                  PAGE_SIZE, BLOCK_N))
        if POS_TABLE:
            slot_pos = _per_slot(ENTRY_POS + entry0, start, slot_end, j, page_size, PAGE_MODE, PAGE_SIZE,
                                 BLOCK_N).to(tl.int64) + off
        else:
            slot_pos = j.to(tl.int64)
        kv_mask = slot_ok[:, None] & d_ok[None, :]
        k_rows = K_CACHE + page[:, None] * stride_kp + off[:, None] * stride_ko + kv_head * stride_kh
        k = tl.load(k_rows + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V_CACHE + page[:, None] * stride_vp + off[:, None] * stride_vo + kv_head * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)
        if KV_FP8:  # the dot's operands in q's dtype
            k = k.to(tl.float32) * k_scale
            v = v.to(tl.float32) * v_scale
            if not (UPCAST and Q.dtype.element_ty == tl.bfloat16):  # the interpreter's bf16 rounding is
                k = k.to(Q.dtype.element_ty)  # not round-to-nearest (twice its error): it stays in fp32
                v = v.to(Q.dtype.element_ty)
        if ROPE:
            # the angle reduced to [0, 2 pi) in 32-bit fixed point (_rope_angle) before the fp32
            # cos/sin: within float rounding of the exact rotation; the rotated key is rounded once
            k2 = tl.load(k_rows + partner[None, :], mask=kv_mask & rot[None, :], other=0.0).to(tl.float32)
            if KV_FP8:
                k2 = k2 * k_scale
            # slot `off` of a page holds its key rotated by `off` (page-local): rotated by the
            # entry's first position slot_pos - off more
            ang = _rope_angle(slot_pos - off, turn_hi, turn_lo)
            if FAST_TRIG:
                cos_a = libdevice.fast_cosf(ang)
                sin_a = libdevice.fast_sinf(ang)
            else:
                cos_a = tl.cos(ang)
                sin_a = tl.sin(ang)
            k_rot = tl.where(rot[None, :], k.to(tl.float32) * cos_a + sgn[None, :] * k2 * sin_a, k.to(tl.float32))
            if UPCAST and Q.dtype.element_ty == tl.bfloat16:
                k = k_rot  # the interpreter's bf16 rounding is not round-to-nearest: stay in fp32
            else:
                k = k_rot.to(k.dtype)  # the dot's operand: rounded once, as a stored rotated key
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE_FP32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        if POS_TABLE or HAS_ENTRY_LEN or HAS_ENTRY_START:
            visible = (slot_pos[None, :] <= q_pos[:, None]) & slot_ok[None, :] & row_ok[:, None]
            if HAS_WINDOW:
                visible = visible & (slot_pos[None, :] >= q_pos[:, None] - window_left)
        elif TILES == 0:
            visible = row_ok[:, None] | (j[None, :] < 0)  # the whole tile: [M, BLOCK_N] of row_ok
        else:
            visible = (j[None, :] <= row_hi[:, None]) & (j[None, :] >= row_lo[:, None]) & j_ok[None, :]
        qk = qk * qk_scale
        if SOFTCAP:
            qk = soft_cap_log2(qk, softcap_log2)
        # a NaN or +inf visible score poisons its row (out and lse NaN) and never enters the
        # softmax; -inf is a valid score of weight 0 (varlen_attention's rule, IEEE softmax)
        nonfinite = (qk != qk) | (qk == float("inf"))
        bad_row = bad_row | tl.max((visible & nonfinite).to(tl.int32), 1)
        qk = tl.where(visible & ~nonfinite, qk, float("-inf"))
        # online softmax; a row with nothing visible so far keeps m = -inf, so shift by 0 instead
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if TILES == 0:
            acc = _pv_whole(acc, p, v, IEEE_FP32)
        elif TILES == 1:
            acc = _pv_masked(acc, p, v, visible, IEEE_FP32)
        elif PIPELINE_V:
            # decided per tile with V used outside the branch, which lets Triton pipeline its load
            # (cp.async, as K's): a masked tile's non-finite V values are zeroed for the dot and put
            # back as NaN where a row sees them; a whole tile's pass through unchanged
            whole = (start >= full_lo) & (start + BLOCK_N - 1 <= full_hi) & (start + BLOCK_N <= slot_end)
            v_bad = ((v != v) | (tl.abs(v) == float("inf"))) & ~whole
            acc = _pv_whole(acc, p, tl.where(v_bad, 0.0, v), IEEE_FP32)
            if not whole:
                acc = _nan_where_seen(acc, visible, v_bad, IEEE_FP32)
        elif (start >= full_lo) & (start + BLOCK_N - 1 <= full_hi) & (start + BLOCK_N <= slot_end):
            acc = _pv_whole(acc, p, v, IEEE_FP32)  # V in both branches: a plain register load
        else:
            acc = _pv_masked(acc, p, v, visible, IEEE_FP32)
        m_i = m_new
    return m_i, l_i, acc, bad_row


@triton.jit
def _paged_attention_kernel(
    Q, Q_POS, CU_SEQLENS_Q, K_CACHE, V_CACHE, PAGES, ROW_START, KV_LENS, TILE_SEQ, TILE_ROW0,
    OUT, LSE,
    ENTRY_POS, ENTRY_LEN, ENTRY_START,  # per page-list entry: slot 0's position, valid slots [start, len)
    INV_FREQ, rotary_dim,  # ROPE: keys stored rotated by their page offset, rotated to their position in fp32
    K_SCALE, V_SCALE,  # KV_FP8: float32 per-tensor scales of float8 caches
    qk_scale,  # softmax scale * log2(e)
    window_left,  # >= 0 when HAS_WINDOW: row i sees slots j >= q_pos[i] - window_left
    softcap_log2,  # logits_soft_cap * log2(e) when SOFTCAP
    stride_qt, stride_qh,
    stride_kp, stride_ko, stride_kh,
    stride_vp, stride_vo, stride_vh,
    stride_bt,  # padded table: PAGES is [B, max_pages] with this row stride (ROW_START unused)
    stride_os, stride_ot, stride_oh,
    stride_ls, stride_lt,
    page_size, head_dim, split_len,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    ROW_STARTS: tl.constexpr,  # PAGES is a flat page list, sequence b's from ROW_START[b] (CSR)
    SOFTCAP: tl.constexpr,  # logits_soft_cap > 0: score -> cap * tanh(score / cap)
    UPCAST: tl.constexpr,  # interpreter only: its tl.dot on bf16 is wrong, compute in fp32
    IEEE_FP32: tl.constexpr,  # fp32 inputs: exact fp32 dots instead of tf32
    POS_TABLE: tl.constexpr = False,  # slot positions from ENTRY_POS (needs ROW_STARTS), not slot indices
    HAS_ENTRY_LEN: tl.constexpr = False,  # slots at offsets >= ENTRY_LEN[entry] do not exist
    HAS_ENTRY_START: tl.constexpr = False,  # nor those at offsets < ENTRY_START[entry]
    ROPE: tl.constexpr = False, ROPE_INTERLEAVED: tl.constexpr = False,
    KV_FP8: tl.constexpr = False,  # float8 K/V: dequantised (x * scale, fp32) right after loading
    EVEN_D: tl.constexpr = False,  # head_dim == BLOCK_D: no head-dim mask on the loads
    PAGE_MODE: tl.constexpr = 0,  # how a key tile finds its pages: 0 one table read per slot (any page
    # size); 1 one per page (PAGE_SIZE divides BLOCK_N); 2 one per tile (BLOCK_N divides PAGE_SIZE)
    PAGE_SIZE: tl.constexpr = 1,  # the page size when PAGE_MODE > 0 (a power of two)
    SPLIT_WHOLE_TILES: tl.constexpr = False,  # whole key tiles in a loop of their own (decode, verify)
    FAST_TRIG: tl.constexpr = False,  # ROPE into a 16-bit dot: the hardware's cos/sin (abs error ~4e-7 on
    # [0, 2 pi), far below the 16-bit rounding of the rotated key) instead of libdevice's precise
    # ones, whose large-argument path kept a stack frame and registers the tile needed
    PIPELINE_V: tl.constexpr = False,  # prefill's per-tile loop: V used outside the whole/masked test
    EDGE_LOOP: tl.constexpr = False,  # decode/verify under a window: the tiles left and right of the whole
    # ones in one masked loop after the whole-tile loop (two loops, the no-window kernel's), not one each
):
    # tiles are laid out in q_pos order within a sequence: start the last (longest) ones first
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(TILE_SEQ + tile)
    # the tile's first row counted from its sequence's start, which is read now: a plan stays
    # right when the engine rewrites cu_seqlens_q in place (rows within the plan's coverage)
    row0 = (tl.load(CU_SEQLENS_Q + seq) + tl.load(TILE_ROW0 + tile)).to(tl.int32)
    row_end = tl.load(CU_SEQLENS_Q + seq + 1)
    kv_len = tl.load(KV_LENS + seq).to(tl.int32)  # <= max_pages * page_size (validated)

    # ---- the tile's query rows: (query row, head of the GQA group) pairs
    r = tl.arange(0, BLOCK_M * GROUP_PAD)
    q_row = row0 + r // GROUP_PAD
    g = r % GROUP_PAD
    row_ok = (q_row < row_end) & (g < GROUP)
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    if EVEN_D:
        d_ok = d < BLOCK_D  # all true, known at compile time: vector loads without a mask
    else:
        d_ok = d < head_dim
    q_row64 = q_row.to(tl.int64)  # row * stride can pass 2^31 elements
    q = tl.load(Q + q_row64[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # ---- each row's visible slots [row_lo, row_hi] clamped to [0, kv_len) in int32: positions
    # (int32 or int64, up to 2^31 - 1 and beyond) are compared in int64 once, never in the loop
    q_pos = tl.load(Q_POS + q_row, mask=row_ok, other=-1).to(tl.int64)
    row_hi = tl.minimum(q_pos, kv_len - 1).to(tl.int32)  # -1 for padding rows: sees nothing
    if HAS_WINDOW:
        row_lo = tl.minimum(tl.maximum(q_pos - window_left, 0), kv_len).to(tl.int32)
        lo_tile = tl.min(tl.where(row_ok, row_lo, kv_len), 0)
    else:
        row_lo = tl.zeros_like(row_hi)
        lo_tile = 0
    hi_tile = tl.max(row_hi, 0) + 1
    # a key tile is fully visible to every row of the tile iff it lies in [max row_lo, min row_hi]
    full_lo = tl.max(tl.where(row_ok, row_lo, 0), 0)
    full_hi = tl.min(tl.where(row_ok, row_hi, kv_len), 0)
    if POS_TABLE or HAS_ENTRY_LEN or HAS_ENTRY_START:
        # a slot's position (or existence) comes from its page-list entry, not its index: every
        # slot of the sequence is a candidate and every tile takes the masked path
        lo_tile = 0
        hi_tile = kv_len
        full_lo = kv_len
        full_hi = -1
    if PAGE_MODE > 0:
        # key tiles start at multiples of BLOCK_N (the slots left of a window are masked), so a
        # tile covers whole pages (mode 1) or lies inside one (mode 2)
        lo_tile = (lo_tile // BLOCK_N) * BLOCK_N
    # ---- this program's split of the tile's key range [lo_tile, hi_tile); the last split takes
    # whatever remains, so a plan made for shorter contexts stays exact (only slower)
    lo = tl.minimum(lo_tile + split * split_len, hi_tile)
    hi = tl.where(split == tl.num_programs(2) - 1, hi_tile, tl.minimum(hi_tile, lo + split_len))

    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], tl.float32)
    bad_row = tl.zeros([BLOCK_M * GROUP_PAD], tl.int32)  # a visible score was NaN/inf
    if ROW_STARTS:
        entry0 = tl.load(ROW_START + seq).to(tl.int64)
    else:
        entry0 = seq.to(tl.int64) * stride_bt
    page_row = PAGES + entry0
    k_scale = 1.0
    v_scale = 1.0
    if KV_FP8:
        k_scale = tl.load(K_SCALE)
        v_scale = tl.load(V_SCALE)
        # a scale must be finite and > 0 (a precondition on the GPU): another reads NaN, never 0
        k_scale = tl.where((k_scale > 0) & (k_scale < float("inf")), k_scale, float("nan"))
        v_scale = tl.where((v_scale > 0) & (v_scale < float("inf")), v_scale, float("nan"))
    rot = d < 0  # (no rotation unless ROPE)
    partner = d
    freq = tl.zeros([BLOCK_D], tl.float64)
    sgn = tl.zeros([BLOCK_D], tl.float32)
    if ROPE:  # the rotation pairs of each head dim: partner dim, frequency index, sign of the sine
        rot = d < rotary_dim
        if ROPE_INTERLEAVED:  # GPT-J: (2i, 2i + 1)
            partner = d ^ 1
            freq = tl.load(INV_FREQ + d // 2, mask=rot, other=0.0).to(tl.float64)
            sgn = tl.where(d % 2 == 0, -1.0, 1.0)
        else:  # NeoX / HF rotate_half: (i, i + rotary_dim / 2)
            half = rotary_dim // 2
            partner = tl.where(d < half, d + half, d - half)
            freq = tl.load(INV_FREQ + tl.where(d < half, d, d - half), mask=rot, other=0.0).to(tl.float64)
            sgn = tl.where(d < half, -1.0, 1.0)
    # each frequency in turns per position (freq / 2 pi, fp64) as a 64-bit fixed-point fraction
    # (turn_hi * 2^-32 + turn_lo * 2^-64), exact to the fp64 value: see _rope_angle
    turns = freq * 0.15915494309189535
    turn_hi = tl.floor(turns * 4294967296.0)
    turn_lo = ((turns * 4294967296.0 - turn_hi) * 4294967296.0).to(tl.uint32)
    turn_hi = turn_hi.to(tl.uint32)
    # the key range in segments, one loop of one kind (TILES) each: a position-tagged table is one
    # masked segment, prefill's 128-row tiles one segment tested tile by tile (three loops would
    # spill), decode and verify tiles three: [lo, f0) and [f1, hi) hold the tiles some row sees
    # only in part (the window's edge, the causal diagonal, the last tile), [f0, f1) the tiles
    # every row sees whole (the bulk of a decode)
    TAGGED: tl.constexpr = POS_TABLE or HAS_ENTRY_LEN or HAS_ENTRY_START
    SEGMENTS: tl.constexpr = ((3 if (HAS_WINDOW and not EDGE_LOOP) else 2) if (SPLIT_WHOLE_TILES and not TAGGED)
                              else 1)
    f0 = tl.minimum(lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_N) * BLOCK_N, hi)
    f1 = f0 + tl.maximum(tl.minimum(full_hi + 1, hi) - f0, 0) // BLOCK_N * BLOCK_N
    # without a window no row's range starts past 0 (full_lo = 0, f0 = lo): the leading masked
    # segment is empty and left out (SEGMENTS 2: one loop less, what keeps 128-row tiles spill-free)
    SEG_FIRST: tl.constexpr = 1 if SEGMENTS == 2 else 0
    SEG_END: tl.constexpr = 1 if SEGMENTS == 1 else 3
    for seg in tl.static_range(SEG_FIRST, SEG_END):
        skip_at = hi  # (no tile moved)
        skip_len = 0
        if SEGMENTS == 1:
            seg_lo = lo
            seg_hi = hi
        elif seg == 0:
            seg_lo = lo
            seg_hi = f0
        elif seg == 1:
            seg_lo = f0
            seg_hi = f1
        elif HAS_WINDOW and EDGE_LOOP:  # [lo, f0) then [f1, hi) in one masked loop
            seg_lo = lo
            seg_hi = f0 + (hi - f1)
            skip_at = f0
            skip_len = f1 - f0
        else:
            seg_lo = f1
            seg_hi = hi
        m_i, l_i, acc, bad_row = _attend_key_tiles(
            m_i, l_i, acc, bad_row, seg_lo, seg_hi, skip_at, skip_len, tl.minimum(hi, seg_hi + skip_len),
            q, q_pos, row_ok, row_lo, row_hi, d, d_ok, Q, K_CACHE, V_CACHE,
            page_row, ENTRY_POS, ENTRY_LEN, ENTRY_START, entry0, kv_head, stride_kp, stride_ko, stride_kh, stride_vp, stride_vo,
            stride_vh, page_size, k_scale, v_scale, rot, partner, turn_hi, turn_lo, sgn, qk_scale, softcap_log2, window_left,
            full_lo, full_hi,
            (1 if TAGGED else 2) if SEGMENTS == 1 else (0 if seg == 1 else 1),  # TILES (a constexpr: no variable)
            BLOCK_N, HAS_WINDOW, SOFTCAP, UPCAST, IEEE_FP32, POS_TABLE, HAS_ENTRY_LEN, HAS_ENTRY_START, ROPE, KV_FP8,
            PAGE_MODE,
            PAGE_SIZE, FAST_TRIG, PIPELINE_V)

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    # the rule of every backend: an output element is finite unless a visible input was not
    out = tl.where((out == out) & (tl.abs(out) < float("inf")) & (bad_row == 0)[:, None], out, float("nan"))
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    lse = tl.where(bad_row == 0, lse, float("nan"))
    o_ptrs = OUT + split.to(tl.int64) * stride_os + q_row64[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + split.to(tl.int64) * stride_ls + q_row64 * stride_lt + head, lse, mask=row_ok)


def run_paged_attention(
    plan: PagedPlan,
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: Optional[float] = None,
    window_left: int = -1,
    out: Optional[torch.Tensor] = None,
    lse_out: Optional[torch.Tensor] = None,
    *,
    row_start: Optional[torch.Tensor] = None,
    entry_pos: Optional[torch.Tensor] = None,
    entry_len: Optional[torch.Tensor] = None,
    entry_start: Optional[torch.Tensor] = None,
    inv_freq: Optional[torch.Tensor] = None,
    rotary_dim: int = 0,
    interleaved: bool = False,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    logits_soft_cap: float = 0.0,
):
    """Launch with a ready plan: no host sync, no CPU tensor (CUDA-graph capturable).

    Inputs as in ``ragattn.paged_attention`` (already validated; the last dim of q and the caches
    and the int tensors' last dim may not be strided: other strides are taken as given). With
    ``row_start`` (int32/int64 ``[B]``), ``block_table`` is a flat page list (``[num_entries]``)
    and sequence ``b``'s logical page ``p`` is ``block_table[row_start[b] + p]`` (FlashInfer's CSR
    ``indices`` with ``row_start = indptr[:-1]``); without it, a padded ``[B, max_pages]`` table.
    ``entry_pos``/``entry_len`` (int32/int64 ``[num_entries]``, flat lists only): the position of
    each entry's slot 0 (slot ``j`` then holds ``entry_pos[e] + j % page_size``, not ``j``) and
    its count of valid slots; ``entry_start`` (same shape): each entry's first valid slot (its
    valid slots ``[entry_start, entry_len)``: a run of the page). ``inv_freq`` (float32
    ``[rotary_dim // 2]``): slot ``o`` of each page holds its key rotated by ``o`` (page-local),
    rotated in the kernel by its entry's first position to its own (``interleaved``: GPT-J pairs).
    ``k_scale``/``v_scale`` (float32, one element each): the caches are float8, dequantised in the kernel.
    ``out``/``lse_out``: where to write (contiguous or not), else new tensors. Returns (out, lse).
    """
    total_q, num_heads, head_dim = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    # the kernel indexes the last dim of q / caches and the 1-D int tensors with unit stride
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_cache = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    v_cache = v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous()
    q_pos, cu_seqlens_q, kv_lens = q_pos.contiguous(), cu_seqlens_q.contiguous(), kv_lens.contiguous()
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    row_start, entry_pos, entry_len, entry_start, inv_freq = (
        None if t is None else t.contiguous() for t in (row_start, entry_pos, entry_len, entry_start, inv_freq))
    # outputs the kernels can store to directly (unit stride in the last dim), else a temporary
    out_k = out if out is not None and out.stride(-1) == 1 else None
    lse_k = lse_out if lse_out is not None and lse_out.stride(-1) == 1 else None
    if out_k is None:
        out_k = torch.empty((total_q, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if lse_k is None:
        lse_k = torch.empty((total_q, num_heads), dtype=torch.float32, device=q.device)
    if plan.num_tiles > 0:
        _launch(plan, q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, row_start, kv_lens, scale,
                window_left, out_k, lse_k, entry_pos, entry_len, entry_start, inv_freq, rotary_dim, interleaved,
                k_scale, v_scale, logits_soft_cap)
    if out is not None and out is not out_k:
        out.copy_(out_k)
    if lse_out is not None and lse_out is not lse_k:
        lse_out.copy_(lse_k)
    return (out if out is not None else out_k), (lse_out if lse_out is not None else lse_k)


def _launch(plan, q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, scale, window_left, out,
            lse_out, entry_pos=None, entry_len=None, entry_start=None, inv_freq=None, rotary_dim=0, interleaved=False,
            k_scale=None, v_scale=None, logits_soft_cap=0.0):
    total_q, num_heads, head_dim = q.shape
    if plan.num_splits == 1:
        o_buf, l_buf = out, lse_out
        stride_os, stride_ls = 0, 0
    else:
        o_buf = torch.empty((plan.num_splits, total_q, num_heads, head_dim), dtype=torch.float32, device=q.device)
        l_buf = torch.empty((plan.num_splits, total_q, num_heads), dtype=torch.float32, device=q.device)
        stride_os, stride_ls = o_buf.stride(0), l_buf.stride(0)

    interp = interpreting()
    has_window = window_left >= 0
    row_starts = row_start is not None
    grid = (plan.num_tiles, k_cache.shape[2], plan.num_splits)
    page_size = k_cache.shape[1]
    mode = page_mode(page_size, plan.block_n, plan.split_len)
    _paged_attention_kernel[grid](
        q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start if row_starts else kv_lens, kv_lens,
        plan.tile_seq, plan.tile_row0,
        o_buf, l_buf,
        kv_lens if entry_pos is None else entry_pos, kv_lens if entry_len is None else entry_len,
        kv_lens if entry_start is None else entry_start,
        q if inv_freq is None else inv_freq, rotary_dim if inv_freq is not None else 0,
        q if k_scale is None else k_scale, q if v_scale is None else v_scale,
        scale * LOG2E,
        window_left if has_window else 0,
        logits_soft_cap * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        0 if row_starts else pages.stride(0),
        stride_os, o_buf.stride(-3), o_buf.stride(-2),
        stride_ls, l_buf.stride(-2),
        k_cache.shape[1], head_dim, plan.split_len,
        GROUP=plan.group, GROUP_PAD=plan.group_pad,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d,
        HAS_WINDOW=has_window, ROW_STARTS=row_starts,
        SOFTCAP=logits_soft_cap > 0,
        UPCAST=interp, IEEE_FP32=(q.dtype == torch.float32 and not interp),
        POS_TABLE=entry_pos is not None, HAS_ENTRY_LEN=entry_len is not None, HAS_ENTRY_START=entry_start is not None,
        ROPE=inv_freq is not None, ROPE_INTERLEAVED=bool(interleaved), KV_FP8=k_scale is not None,
        EVEN_D=head_dim == plan.block_d, PAGE_MODE=mode, PAGE_SIZE=page_size if mode else 1,
        SPLIT_WHOLE_TILES=split_whole_tiles(plan.block_m * plan.group_pad), PIPELINE_V=bool(plan.pipeline_v),
        EDGE_LOOP=bool(plan.edge_loop),
        FAST_TRIG=inv_freq is not None and not interp and q.element_size() == 2,
        # keys rotated in the kernel hold more per key element: 4 warps spilled at decode's 64 x 128
        # key tile (sm_90 ptxas: 892 bytes), 8 do not
        num_warps=plan.num_warps if inv_freq is None else max(plan.num_warps, 8),
        num_stages=plan.num_stages,
    )
    if o_buf is not out:
        merge_split_states(o_buf, l_buf, out, lse_out)


def paged_attention_fwd(
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
    num_splits: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    lse_out: Optional[torch.Tensor] = None,
    logits_soft_cap: float = 0.0,
):
    """Plan (one host sync) and run: the one-call form of ``plan_paged_attention`` + ``run_paged_attention``."""
    plan = plan_paged_attention(
        cu_seqlens_q, kv_lens, num_heads=q.shape[1], num_kv_heads=k_cache.shape[2], head_dim=q.shape[2],
        dtype=q.dtype, window_left=window_left, num_splits=num_splits,
    )
    return run_paged_attention(plan, q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale,
                               window_left, out, lse_out, logits_soft_cap=logits_soft_cap)
