"""Q-indexed attention over a paged KV cache: sparse prefill, speculative tails and decode.

One kernel serves every case. A program owns one *query tile* of one sequence (up to BLOCK_M
consecutive query rows of that sequence) for one KV head, and stacks the rows x the GQA group of
query heads that read that KV head into the rows of its tile, so ``tl.dot`` sees
``M = BLOCK_M * GROUP_PAD`` rows while each K/V tile is loaded once for the whole group::

    tile rows:  (row0, h0) (row0, h1) .. (row0, hG-1) (row1, h0) ..      <- M = BLOCK_M * GROUP_PAD
    key tiles:  [0, BLOCK_N) [BLOCK_N, 2 BLOCK_N) ..  up to min(kv_len, max q_pos of the tile + 1)

Row ``i`` sees slot ``j`` iff ``j < kv_len`` and ``j <= q_pos[i]``; key tiles past the tile's
largest position are never visited, so work is proportional to the visible keys. Slot ``j`` is
read from page ``block_table[b, j // page_size]`` at offset ``j % page_size`` (any page size, pages
in any order). The softmax is the online (FlashAttention) one in base 2 with fp32 statistics.

Split-KV (few query rows against long contexts, e.g. decode): a third grid axis cuts the key range
into ``num_splits`` pieces of ``split_len`` slots; each program writes its normalised partial
output and LSE in fp32, and ``merge_split_states`` reduces them exactly.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .merge_attention_states import merge_split_states

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _paged_attention_kernel(
    Q, Q_POS, CU_SEQLENS_Q, K_CACHE, V_CACHE, BLOCK_TABLE, KV_LENS, TILE_SEQ, TILE_ROW0,
    OUT, LSE,
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh,
    stride_kp, stride_ko, stride_kh,
    stride_vp, stride_vo, stride_vh,
    stride_bt,
    stride_os, stride_ot, stride_oh,
    stride_ls, stride_lt,
    page_size, head_dim, split_len,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only: its tl.dot on bf16 is wrong, compute in fp32
    IEEE_FP32: tl.constexpr,  # fp32 inputs: exact fp32 dots instead of tf32
):
    # tiles are laid out in q_pos order within a sequence: start the last (longest) ones first
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(TILE_SEQ + tile)
    row0 = tl.load(TILE_ROW0 + tile)
    row_end = tl.load(CU_SEQLENS_Q + seq + 1)
    kv_len = tl.load(KV_LENS + seq)

    # ---- the tile's query rows: (query row, head of the GQA group) pairs
    r = tl.arange(0, BLOCK_M * GROUP_PAD)
    q_row = row0 + r // GROUP_PAD
    g = r % GROUP_PAD
    row_ok = (q_row < row_end) & (g < GROUP)
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q_pos = tl.load(Q_POS + q_row, mask=row_ok, other=-1)
    q = tl.load(Q + q_row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # ---- key range of this program: visible slots of the tile, cut to this split
    hi = tl.minimum(kv_len, tl.max(q_pos, 0) + 1)
    lo = split * split_len
    hi = tl.minimum(hi, lo + split_len)

    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], tl.float32)
    page_row = BLOCK_TABLE + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        page = tl.load(page_row + j // page_size, mask=j_ok, other=0).to(tl.int64)
        off = j % page_size
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(K_CACHE + page[:, None] * stride_kp + off[:, None] * stride_ko + kv_head * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(V_CACHE + page[:, None] * stride_vp + off[:, None] * stride_vo + kv_head * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE_FP32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        visible = (j[None, :] <= q_pos[:, None]) & j_ok[None, :]
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        # online softmax; a row with nothing visible so far keeps m = -inf, so shift by 0 instead
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_ptrs = OUT + split * stride_os + q_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + split * stride_ls + q_row * stride_lt + head, lse, mask=row_ok)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tile_config(m_tile: int, block_d: int, elt: int, interp: bool):
    """(m_tile, block_n, num_stages, num_warps) whose tiles fit the shared memory of an H100.

    Budget ~160 KB for the Q tile plus ``num_stages`` K and V tiles (leaving room for Triton's
    layout-conversion scratch); shrink stages, then the key tile, then the query tile.
    """
    if interp:  # the interpreter's cost is programs x loop trips: big tiles, no pipelining
        return m_tile, 64, 1, 4
    block_n, stages = 64, 3

    def smem(m, n, st):
        return elt * block_d * (m + 2 * n * st)

    while smem(m_tile, block_n, stages) > 160 * 1024:
        if stages > 2:
            stages -= 1
        elif block_n > 32:
            block_n //= 2
        elif m_tile > 16:
            m_tile //= 2
        else:
            break
    return m_tile, block_n, stages, 8 if m_tile >= 128 else 4


def choose_num_splits(num_programs: int, max_kv_len: int, block_n: int, device: torch.device) -> int:
    """Split the key range when the grid would leave the GPU under-filled (decode, few rows).

    Aim for ~4 programs per SM, keeping every split at least 4 key tiles long.
    """
    if device.type != "cuda" or num_programs == 0:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if num_programs >= 4 * sms:
        return 1
    key_tiles = triton.cdiv(max(max_kv_len, 1), block_n)
    return max(1, min(triton.cdiv(4 * sms, num_programs), key_tiles // 4, 64))


def paged_attention_fwd(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: Optional[float] = None,
    *,
    num_splits: Optional[int] = None,
):
    """Launch the kernel (inputs already validated; shapes as in ``ragattn.paged_attention``).

    ``num_splits`` forces the split-KV factor (None: ``choose_num_splits``). Copies
    ``cu_seqlens_q`` and ``kv_lens`` to the host once to build the query-tile map.
    """
    total_q, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    # the kernel indexes the last dim of q / caches and the 1-D int tensors with unit stride
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_cache = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    v_cache = v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous()
    q_pos, cu_seqlens_q, kv_lens = q_pos.contiguous(), cu_seqlens_q.contiguous(), kv_lens.contiguous()
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    out = torch.empty((total_q, num_heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((total_q, num_heads), dtype=torch.float32, device=q.device)
    batch = kv_lens.numel()
    if total_q == 0 or batch == 0:
        return out, lse

    host = torch.cat([cu_seqlens_q, kv_lens]).cpu()
    cu, lens = host[: batch + 1], host[batch + 1 :]
    rows = cu[1:] - cu[:-1]
    max_rows, max_kv = int(rows.max()), int(lens.max())

    # tile shape: rows x group stacked to M = BLOCK_M * GROUP_PAD in [16, 128] (tl.dot needs M >= 16)
    group_pad = triton.next_power_of_2(group)
    m_tile = min(128, max(16, triton.next_power_of_2(max_rows * group_pad)))
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    interp = _interpreting()
    m_tile, block_n, num_stages, num_warps = tile_config(m_tile, block_d, q.element_size(), interp)
    block_m = max(1, m_tile // group_pad)

    tiles_per_seq = (rows + block_m - 1) // block_m
    tile_seq = torch.repeat_interleave(torch.arange(batch, dtype=torch.int32), tiles_per_seq)
    first_tile = torch.cumsum(tiles_per_seq, 0) - tiles_per_seq
    tile_idx = torch.arange(tile_seq.numel(), dtype=torch.int32) - first_tile[tile_seq.long()]
    tile_row0 = (cu[:-1][tile_seq.long()] + tile_idx * block_m).to(torch.int32)
    num_tiles = tile_seq.numel()
    tile_seq = tile_seq.to(q.device, non_blocking=True)
    tile_row0 = tile_row0.to(q.device, non_blocking=True)

    if num_splits is None:
        num_splits = choose_num_splits(num_tiles * num_kv_heads, max_kv, block_n, q.device)
    split_len = triton.cdiv(triton.cdiv(max(max_kv, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(max(max_kv, 1), split_len))

    if num_splits == 1:
        o_buf, l_buf = out, lse
        stride_os, stride_ls = 0, 0
    else:
        o_buf = torch.empty((num_splits, total_q, num_heads, head_dim), dtype=torch.float32, device=q.device)
        l_buf = torch.empty((num_splits, total_q, num_heads), dtype=torch.float32, device=q.device)
        stride_os, stride_ls = o_buf.stride(0), l_buf.stride(0)

    grid = (num_tiles, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, tile_seq, tile_row0,
        o_buf, l_buf,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        stride_os, o_buf.stride(-3), o_buf.stride(-2),
        stride_ls, l_buf.stride(-2),
        page_size, head_dim, split_len,
        GROUP=group, GROUP_PAD=group_pad,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        UPCAST=interp, IEEE_FP32=(q.dtype == torch.float32 and not interp),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        merge_split_states(o_buf, l_buf, out, lse)
    return out, lse
