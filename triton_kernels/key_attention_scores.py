"""Triton kernels of ``key_attention_scores``: per-key attention mass, two passes.

For a sequence with query rows ``i``, query heads ``h`` and key rows ``j``::

    p[h, i, j] = exp(s[h, i, j] - lse[h, i]),   s = scale * q[i, h] . k[j, h // G]
    scores[j]  = sum_h sum_i p[h, i, j]

The ``[heads, q, k]`` probability tensor is never stored:

* pass 1 (``_row_lse_kernel``) streams the key tiles and keeps an online max / sum per query row
  and head, like the forward pass of the fused-attention tutorial without the ``P @ V`` part.
  A long key range is split over ``num_splits`` programs, as many as it takes to give the GPU
  ``waves`` x its SM count programs (``waves`` from the config table, the SM count from the
  device), so that a short question against a long context still fills every SM.
  The splits' partial LSEs are merged by one small kernel (``_merge_lse_kernel``; torch's
  logsumexp took ~5 launches).
* pass 2 recomputes ``s``, exponentiates against the merged LSE and sums down the columns, in one
  of two designs (the config table's ``column_pass``):

  - ``"split"`` (``_column_sum_split_kernel``): pass 1's grid. A program owns one packed-row tile of
    one kv head and one key split, merges its rows' split LSEs itself (no merge launch), and streams
    the split's key tiles in one pipelined loop (K read once per row tile, the row tiles of a split
    side by side in launch order so the second reads it from L2; the splits walk backwards, so the
    tiles pass 1 read last, still in L2, come first). It stores each key tile's sum over its rows
    into ``[row tiles, kv heads, total_k]``, summed by one reduction at the end.
  - ``"tile"`` (``_column_sum_kernel``, the first design, kept for A/B): each program owns one key
    tile of one kv head and loops over all the sequence's query rows of the kv head's group.

  Either way every key's score is written once, without atomics, deterministically.

Tiles, warps, stages, the wave target and the pass-2 design come from
``configs/key_attention_scores.json`` per GPU and shape class (``gpu_configs.get_config``).

GQA is handled by packing: the ``G`` query heads that share kv head ``hk`` are laid out as
``G * num_q`` "packed rows", row ``r`` being query row ``r // G`` of head ``hk * G + r % G``;
each loaded key tile then serves all ``G`` heads at once.

All logits are kept in base 2 (``scale * log2(e)`` folded into the logits) so the kernels use
``exp2``; softmax and sums are float32 whatever the input dtype.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from ragattn.triton_kernels.gpu_configs import DEFAULT, device_name, dtype_class, get_config, sm_count

# The interpreter's tl.dot on bf16 returns garbage: upcast to fp32 there (and only there).
_UPCAST_FOR_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _load_q_tile(q_ptr, q_start, num_q, kv_head, stride_qt, stride_qh, r_offs, d_offs,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Packed query rows ``r_offs`` of kv head ``kv_head``: [BLOCK_M, BLOCK_D] (masked)."""
    rows = r_offs // GROUP
    heads = kv_head * GROUP + r_offs % GROUP
    mask = (rows < num_q)[:, None] & (d_offs < HEAD_DIM)[None, :]
    ptrs = q_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh + d_offs[None, :]
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _load_k_tile_t(k_ptr, k_start, num_k, kv_head, stride_kt, stride_kh, n_offs, d_offs,
                   HEAD_DIM: tl.constexpr):
    """Key rows ``n_offs`` of kv head ``kv_head``, transposed: [BLOCK_D, BLOCK_N] (masked)."""
    mask = (d_offs < HEAD_DIM)[:, None] & (n_offs < num_k)[None, :]
    ptrs = k_ptr + (k_start + n_offs).to(tl.int64)[None, :] * stride_kt + kv_head * stride_kh + d_offs[:, None]
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _logits(q, kt, qk_scale, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """``q @ kt`` in fp32, times ``qk_scale`` (= scale * log2 e)."""
    if UPCAST:
        q = q.to(tl.float32)
        kt = kt.to(tl.float32)
    if IEEE:  # fp32 inputs: no TF32, so fp32 inputs get fp32 accuracy
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    return s * qk_scale


@triton.jit
def _row_lse_kernel(
    q_ptr, k_ptr, cu_q_ptr, cu_k_ptr, lse_ptr,  # lse: fp32 [NUM_SPLITS, total_q, num_heads], base 2
    qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh,
    total_q, num_heads, num_splits, num_q_tiles,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Pass 1: base-2 LSE of each packed query row over one split of the sequence's keys.

    Grid ``(num_q_tiles * batch, num_kv_heads * num_splits)``: the batch shares axis 0 (up to
    2^31 - 1 programs) with the tiles, since axes 1 and 2 stop at 65535."""
    tile_m = tl.program_id(0) % num_q_tiles
    seq = tl.program_id(0) // num_q_tiles
    kv_head = tl.program_id(1) // num_splits
    split = tl.program_id(1) % num_splits

    q_start = tl.load(cu_q_ptr + seq)
    num_q = tl.load(cu_q_ptr + seq + 1) - q_start
    k_start = tl.load(cu_k_ptr + seq)
    num_k = tl.load(cu_k_ptr + seq + 1) - k_start
    if tile_m * BLOCK_M >= num_q * GROUP:
        return

    # This split's key range, in whole key tiles.
    tiles_per_split = tl.cdiv(tl.cdiv(num_k, BLOCK_N), num_splits)
    n_begin = split * tiles_per_split * BLOCK_N
    n_end = tl.minimum(n_begin + tiles_per_split * BLOCK_N, num_k)

    r_offs = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d_offs = tl.arange(0, BLOCK_D)
    q = _load_q_tile(q_ptr, q_start, num_q, kv_head, stride_qt, stride_qh, r_offs, d_offs, GROUP, HEAD_DIM)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i)
    for n0 in range(n_begin, n_end, BLOCK_N):
        n_offs = n0 + tl.arange(0, BLOCK_N)
        kt = _load_k_tile_t(k_ptr, k_start, num_k, kv_head, stride_kt, stride_kh, n_offs, d_offs, HEAD_DIM)
        s = _logits(q, kt, qk_scale, UPCAST, IEEE)
        s = tl.where((n_offs < n_end)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m_i = m_new

    # An empty split leaves m_i = -inf and l_i = 0: its LSE is -inf, neutral in the merge. A NaN
    # or +inf logit makes l_i NaN, and the LSE stays NaN (the documented rule: the sequence's
    # scores all become NaN, as in the reference), never -inf.
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
    rows = r_offs // GROUP
    heads = kv_head * GROUP + r_offs % GROUP
    out_ptrs = lse_ptr + (split.to(tl.int64) * total_q + q_start + rows) * num_heads + heads
    tl.store(out_ptrs, lse, mask=rows < num_q)


@triton.jit
def _merge_lse_kernel(parts_ptr, lse_ptr, n, num_splits, BLOCK: tl.constexpr):
    """Base-2 LSE over pass 1's ``num_splits`` partials (``[num_splits, n]`` -> ``[n]``, n = total_q x
    heads): -inf when every split is empty, NaN when any is NaN (the sequence's documented rule: a
    NaN split makes ``acc`` NaN whatever ``tl.maximum`` does with it). One launch instead of torch's
    logsumexp (~5), and pass 2's main loop stays a single pipelined loop."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(lse_ptr + offs, _merged_lse(parts_ptr + offs, n, ok, num_splits, BLOCK), mask=ok)


@triton.jit
def _merged_lse(ptrs, n, ok, num_splits, BLOCK: tl.constexpr):
    """Base-2 LSE over ``num_splits`` partials at ``ptrs``, ``ptrs + n``, ... ([BLOCK] entries, ``ok``
    masked): the merge rule of both the merge kernel and pass 2's split design (-inf when every split is
    empty, NaN when any is NaN)."""
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(num_splits):
        x = tl.load(ptrs, mask=ok, other=float("-inf"))
        ptrs += n  # 64-bit pointer arithmetic: splits x n may pass 2^31
        m_new = tl.maximum(m, x)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no (-inf) - (-inf)
        acc = acc * tl.exp2(m - m_ref) + tl.exp2(x - m_ref)
        m = m_new
    return tl.where(acc == 0.0, float("-inf"), m + tl.log2(tl.where(acc == 0.0, 1.0, acc)))


@triton.jit
def _column_sum_kernel(
    q_ptr, k_ptr, cu_q_ptr, cu_k_ptr, lse_ptr,  # lse: fp32 [total_q, num_heads], base 2
    partial_ptr,  # fp32 [num_kv_heads, total_k]: this kv head's share of each key's score
    qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh,
    total_k, num_heads, num_k_tiles,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Pass 2: for one key tile of one kv head, sum exp2(s - lse) over all packed query rows.

    Grid ``(num_k_tiles * batch, num_kv_heads)`` (the batch on axis 0, as in pass 1)."""
    tile_n = tl.program_id(0) % num_k_tiles
    seq = tl.program_id(0) // num_k_tiles
    kv_head = tl.program_id(1)

    q_start = tl.load(cu_q_ptr + seq)
    num_q = tl.load(cu_q_ptr + seq + 1) - q_start
    k_start = tl.load(cu_k_ptr + seq)
    num_k = tl.load(cu_k_ptr + seq + 1) - k_start
    if tile_n * BLOCK_N >= num_k:
        return

    n_offs = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    d_offs = tl.arange(0, BLOCK_D)
    kt = _load_k_tile_t(k_ptr, k_start, num_k, kv_head, stride_kt, stride_kh, n_offs, d_offs, HEAD_DIM)

    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for m0 in range(0, num_q * GROUP, BLOCK_M):  # no query rows: the tile's scores stay 0
        r_offs = m0 + tl.arange(0, BLOCK_M)
        rows = r_offs // GROUP
        heads = kv_head * GROUP + r_offs % GROUP
        row_ok = rows < num_q
        q = _load_q_tile(q_ptr, q_start, num_q, kv_head, stride_qt, stride_qh, r_offs, d_offs, GROUP, HEAD_DIM)
        lse = tl.load(lse_ptr + (q_start + rows).to(tl.int64) * num_heads + heads, mask=row_ok, other=float("inf"))
        s = _logits(q, kt, qk_scale, UPCAST, IEEE)
        # Padded rows are selected out (not exp'd to 0: their logit is NaN against a NaN key).
        p = tl.where(row_ok[:, None], tl.exp2(s - lse[:, None]), 0.0)
        acc += tl.sum(p, axis=0)

    tl.store(partial_ptr + kv_head.to(tl.int64) * total_k + k_start + n_offs, acc, mask=n_offs < num_k)


@triton.jit
def _column_sum_split_kernel(
    q_ptr, k_ptr, cu_q_ptr, cu_k_ptr, lse_ptr,  # lse: pass 1's fp32 [num_splits, total_q, num_heads], base 2
    partial_ptr,  # fp32 [num_q_tiles, num_kv_heads, total_k]: one row tile's share of each key's score
    qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh,
    total_q, total_k, num_kv_heads, num_splits, num_q_tiles,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Pass 2, split over the keys like pass 1 (``column_pass="split"``): one program per (row tile,
    kv head, key split) merges its rows' split LSEs from pass 1 itself (no merge launch), holds its
    packed query rows (transposed, ``[BLOCK_D, BLOCK_M]``) and their LSEs for the whole loop and
    streams the split's key tiles (pipelined), computing the transposed
    logits ``[BLOCK_N, BLOCK_M]`` (keys on the MMA's M side, so the column sums are row reductions
    inside a warp) and storing each key tile's sum over its rows. The splits walk their key tiles
    from the end backwards and in reverse split order: pass 1 read them forwards, so the tiles it
    read last (still in L2 when K is bigger than it) come first.

    Grid ``(num_q_tiles * batch, num_kv_heads * num_splits)`` (pass 1's). A row tile past its
    sequence's rows (or a sequence without rows) stores zeros: every entry of ``partial`` is written."""
    tile_m = tl.program_id(0) % num_q_tiles
    seq = tl.program_id(0) // num_q_tiles
    kv_head = tl.program_id(1) // num_splits
    split = num_splits - 1 - tl.program_id(1) % num_splits

    q_start = tl.load(cu_q_ptr + seq)
    num_q = tl.load(cu_q_ptr + seq + 1) - q_start
    k_start = tl.load(cu_k_ptr + seq)
    num_k = tl.load(cu_k_ptr + seq + 1) - k_start

    tiles_per_split = tl.cdiv(tl.cdiv(num_k, BLOCK_N), num_splits)
    n_begin = split * tiles_per_split * BLOCK_N
    n_end = tl.minimum(n_begin + tiles_per_split * BLOCK_N, num_k)
    n_tiles = tl.cdiv(tl.maximum(n_end - n_begin, 0), BLOCK_N)

    r_offs = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d_offs = tl.arange(0, BLOCK_D)
    rows = r_offs // GROUP
    heads = kv_head * GROUP + r_offs % GROUP
    row_ok = rows < num_q
    qt = tl.trans(_load_q_tile(q_ptr, q_start, num_q, kv_head, stride_qt, stride_qh, r_offs, d_offs, GROUP,
                               HEAD_DIM))  # [BLOCK_D, BLOCK_M]
    num_heads = num_kv_heads * GROUP
    lse = _merged_lse(lse_ptr + (q_start + rows).to(tl.int64) * num_heads + heads, total_q * num_heads, row_ok,
                      num_splits, BLOCK_M)
    lse = tl.where(row_ok, lse, float("inf"))
    out_base = partial_ptr + (tile_m.to(tl.int64) * num_kv_heads + kv_head) * total_k + k_start
    # a tile without rows loads no key (its sums are stored as zeros): the keys it loads end at
    # n_begin. (A block mask and-ed with a scalar condition fails triton 3.9's interpreter, which
    # keeps a scalar comparison's result as int32.)
    n_load = tl.where(tile_m * BLOCK_M < num_q * GROUP, n_end, n_begin)
    for i in range(0, n_tiles):
        n_offs = n_begin + (n_tiles - 1 - i) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n_offs < n_end
        mask = (n_offs < n_load)[:, None] & (d_offs < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + (k_start + n_offs).to(tl.int64)[:, None] * stride_kt + kv_head * stride_kh
                    + d_offs[None, :], mask=mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = _logits(k, qt, qk_scale, UPCAST, IEEE)  # [BLOCK_N, BLOCK_M]
        # padded rows are selected out (not exp'd to 0: their logit is NaN against a NaN key)
        p = tl.where(row_ok[None, :], tl.exp2(s - lse[None, :]), 0.0)
        tl.store(out_base + n_offs, tl.sum(p, axis=1), mask=n_ok)


_MERGE_BLOCK = 1024  # LSE entries per program of the split merge
# Pass 2's designs (the config table's "column_pass"): "split", pass 1's grid (_column_sum_split_kernel);
# "tile", one program per key tile looping over the query rows (_column_sum_kernel, the design before it).
COLUMN_PASSES = ("split", "tile")


def config_key(dtype: torch.dtype, head_dim: int) -> str:
    """The shape class in ``configs/key_attention_scores.json``: dtype class and padded head dim."""
    d = max(16, triton.next_power_of_2(head_dim))
    return f"{dtype_class(dtype)}/" + ("d64" if d <= 64 else "d128" if d <= 128 else "d256")


def kernel_config(dtype: torch.dtype, head_dim: int, device_name: Optional[str]) -> dict:
    """The table's config (BLOCK_M, BLOCK_N, num_warps, num_stages, waves) for a GPU by name
    (``DEFAULT``: the heuristic for unknown GPUs), or for the interpreter (None)."""
    return get_config("key_attention_scores", device_name, config_key(dtype, head_dim))


def launch_config(dtype: torch.dtype, head_dim: int, *, on_gpu: bool, device_name: Optional[str] = None):
    """(BLOCK_M, BLOCK_N, num_warps) for both passes (``kernel_config`` has the rest)."""
    c = kernel_config(dtype, head_dim, (device_name or DEFAULT) if on_gpu else None)
    return c["BLOCK_M"], c["BLOCK_N"], c["num_warps"]


def splits_for_sms(num_q_tiles: int, batch: int, num_kv_heads: int, max_k_tiles: int, sms: int,
                   waves: float = 2.0, min_tiles: int = 4) -> int:
    """Pass 1's key splits on a GPU of ``sms`` SMs: enough programs for ``waves`` x ``sms``, each at
    least ``min_tiles`` key tiles (a split costs a partial LSE per row and a merge step). Pure: the
    static sm_90 report and the tests ask it too."""
    programs = max(1, num_q_tiles * batch * num_kv_heads)
    want = max(1, int(waves * sms // programs))  # at most waves x sms programs: no straggling extra wave
    return max(1, min(want, triton.cdiv(max_k_tiles, min_tiles)))


def key_attention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: Optional[float] = None,
    *,
    num_splits: Optional[int] = None,
    column_pass: Optional[str] = None,
) -> torch.Tensor:
    """Launch both passes. q ``[total_q, H, D]``, k ``[total_k, Hkv, D]`` (same dtype), cu_seqlens
    int32 ``[B + 1]``; returns float32 ``[total_k]``. Inputs are assumed validated (ragattn.ops).
    ``num_splits`` overrides the pass-1 key split count (tests); ``column_pass`` the table's pass-2
    design (``COLUMN_PASSES``: "split" or "tile", for A/B runs and tests)."""
    total_q, num_heads, head_dim = q.shape
    total_k, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    batch = cu_seqlens_q.numel() - 1
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.int(), cu_seqlens_k.int()  # int64 accepted, read as int32
    if total_q == 0 or total_k == 0 or batch == 0:
        return torch.zeros(total_k, dtype=torch.float32, device=q.device)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    qk_scale = scale * 1.4426950408889634  # log2(e)

    # The grids need the longest query and key ranges: free for one sequence, else one host sync.
    if batch == 1:
        max_q, max_k = total_q, total_k
    else:
        lens = torch.stack([cu_seqlens_q.diff().max(), cu_seqlens_k.diff().max()]).tolist()
        max_q, max_k = int(lens[0]), int(lens[1])
    if max_q == 0 or max_k == 0:
        return torch.zeros(total_k, dtype=torch.float32, device=q.device)

    p = launch_params(max_q, max_k, batch, num_heads, num_kv_heads, head_dim, q.dtype, q.device, num_splits,
                      column_pass)
    block_m, block_n, num_splits = p["BLOCK_M"], p["BLOCK_N"], p["num_splits"]
    upcast = _UPCAST_FOR_INTERPRETER and q.dtype != torch.float32
    common = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=p["BLOCK_D"], UPCAST=upcast, IEEE=q.dtype == torch.float32,
                  BLOCK_M=block_m, BLOCK_N=block_n, num_warps=p["num_warps"], num_stages=p["num_stages"])
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1))

    # Pass 1: per-split LSEs of each packed query row (base 2).
    lse_parts = torch.empty((num_splits, total_q, num_heads), dtype=torch.float32, device=q.device)
    _row_lse_kernel[p["grid1"]](
        q, k, cu_seqlens_q, cu_seqlens_k, lse_parts, qk_scale, *strides, total_q, num_heads, num_splits,
        p["num_q_tiles"], **common,
    )

    if p["column_pass"] == "split":
        # Pass 2 over pass 1's grid, merging the split LSEs itself: column sums per (row tile, kv
        # head), then over both (one [num_q_tiles * Hkv, total_k] reduction); every entry is written
        # (zeros past a sequence's rows).
        partial = torch.empty((p["num_q_tiles"], num_kv_heads, total_k), dtype=torch.float32, device=q.device)
        _column_sum_split_kernel[p["grid1"]](
            q, k, cu_seqlens_q, cu_seqlens_k, lse_parts, partial, qk_scale, *strides, total_q, total_k, num_kv_heads,
            num_splits, p["num_q_tiles"], **common,
        )
        return partial.view(-1, total_k).sum(dim=0)
    if num_splits == 1:
        lse = lse_parts[0]
    else:  # the splits' partial LSEs merged in one launch
        lse = torch.empty((total_q, num_heads), dtype=torch.float32, device=q.device)
        n = total_q * num_heads
        _merge_lse_kernel[(triton.cdiv(n, _MERGE_BLOCK),)](lse_parts, lse, n, num_splits, BLOCK=_MERGE_BLOCK)
    # Pass 2, one program per key tile ("tile"): column sums per kv head, then over the kv heads (a
    # [Hkv, total_k] reduction). Every key belongs to a sequence with at least one key tile, so every
    # entry gets written.
    partial = torch.empty((num_kv_heads, total_k), dtype=torch.float32, device=q.device)
    _column_sum_kernel[p["grid2"]](
        q, k, cu_seqlens_q, cu_seqlens_k, lse, partial, qk_scale, *strides, total_k, num_heads, p["max_k_tiles"],
        **common,
    )
    return partial.sum(dim=0) if num_kv_heads > 1 else partial[0]


def launch_params(max_q: int, max_k: int, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device, num_splits: Optional[int] = None,
                  column_pass: Optional[str] = None) -> dict:
    """Everything the launcher decides for a problem: the table's config for the device (tiles, warps,
    stages, wave target, pass-2 design), pass 1's key splits and both grids (also what the benchmark
    records). ``column_pass`` overrides the table's pass-2 design."""
    on_gpu = device.type == "cuda"
    cfg = dict(kernel_config(dtype, head_dim, device_name(device) if on_gpu else None))
    cfg["column_pass"] = column_pass or cfg.get("column_pass", "tile")
    if cfg["column_pass"] not in COLUMN_PASSES:
        raise ValueError(f"key_attention_scores: column_pass must be one of {COLUMN_PASSES}, "
                         f"got {cfg['column_pass']!r}")
    group = num_heads // num_kv_heads
    num_q_tiles = triton.cdiv(max_q * group, cfg["BLOCK_M"])
    max_k_tiles = triton.cdiv(max_k, cfg["BLOCK_N"])
    if num_splits is None:
        num_splits = 1 if not on_gpu else splits_for_sms(  # the interpreter pays per program
            num_q_tiles, batch, num_kv_heads, max_k_tiles, sm_count(device), cfg.get("waves", 2.0))
    num_splits = max(1, min(int(num_splits), max_k_tiles))
    return dict(cfg, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_q_tiles=num_q_tiles,
                max_k_tiles=max_k_tiles, num_splits=num_splits,
                grid1=(num_q_tiles * batch, num_kv_heads * num_splits), grid2=(max_k_tiles * batch, num_kv_heads))
