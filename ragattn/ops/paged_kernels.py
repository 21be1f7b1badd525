"""The backends of the paged-attention ops on validated arguments: the C++ CPU kernels (padded
tables; position-tagged page lists with their RoPE table), the Triton kernel (one call, or with a
plan) and the reference, each called the one way both ops and ``PagedAttentionStep`` share.

    cpu_kernel(q, q_pos, cu, k, v, block_table, kv_lens, scale, window_left, soft_cap[, out, lse_out])
    triton_one_call(q, q_pos, cu, k, v, block_table, kv_lens, scale, window_left[, out, lse_out, soft_cap])
    run_on_backend(*run_op_args[, out, lse_out])   # the run op's body
    rope_position_table(inv_freq, positions); rope_table(inv_freq, positions)   # the tagged kernel's cos/sin
    call_out(op.out, args, q, out, lse_out)  # an .out overload with the missing output allocated
"""
from __future__ import annotations

import math
import os
import weakref
from typing import Optional, Tuple

import torch

from ragattn.ops import backend
from ragattn.ops._validate import device_guard
from ragattn.ops.page_table import num_pages
from ragattn.ops.paged_checks import has_entries
from ragattn.reference.paged_attention import paged_attention as _reference

_OP = "paged_attention"

# Forces the number of key-range partitions (split-KV) of the Triton kernel; unset or "auto"
# lets a heuristic choose (tests set it to compare split and unsplit results).
NUM_SPLITS_ENV = "RAGATTN_PAGED_NUM_SPLITS"


def forced_num_splits() -> Optional[int]:
    value = os.environ.get(NUM_SPLITS_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    n = int(value)
    if n < 1:
        raise ValueError(f"ragattn.{_OP}: {NUM_SPLITS_ENV} must be a positive integer or 'auto', got {value!r}")
    return n


def call_out(op_out, args, q, out, lse_out):
    """``op_out(*args, out=, lse_out=)`` with the missing one of ``out`` / ``lse_out`` allocated
    (``[total_q, H, D]`` in q's dtype, float32 ``[total_q, H]``); returns both."""
    if out is None:
        out = q.new_empty(q.shape)
    if lse_out is None:
        lse_out = q.new_empty(q.shape[:2], dtype=torch.float32)
    op_out(*args, out=out, lse_out=lse_out)
    return out, lse_out


def default_scale(scale, head_dim: int) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


def cpu_kernel(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left, logits_soft_cap,
                out=None, lse_out=None):
    """The C++ kernel over a padded ``block_table`` (``ragattn::_paged_attention_cpu``), on
    validated metadata; it checks the index values it follows itself."""
    if out is None:
        out = q.new_empty(q.shape)                                  # contiguous, like the fake impl
        lse_out = q.new_empty(q.shape[:2], dtype=torch.float32)
    torch.ops.ragattn._paged_attention_cpu(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens,
                                           default_scale(scale, q.shape[-1]), window_left, float(logits_soft_cap),
                                           out=out, lse_out=lse_out)
    return out, lse_out


def triton_one_call(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left, out=None, lse_out=None,
            logits_soft_cap=0.0):
    from ragattn.triton_kernels.paged_attention import paged_attention_fwd

    with device_guard(q):
        return paged_attention_fwd(
            q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left,
            num_splits=forced_num_splits(), out=out, lse_out=lse_out, logits_soft_cap=logits_soft_cap,
        )


# The CPU tagged kernel's cos/sin table covers positions 0 .. max(q_pos): up to 2^20 of them (256
# MiB at rotary_dim 128); rows at later positions run the reference instead.
ROPE_TABLE_MAX_POSITIONS = 1 << 20


def rope_position_table(inv_freq: torch.Tensor, positions: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[positions, rotary_dim // 2]`` cos and sin of the RoPE angles ``p * inv_freq[i]``
    of positions ``0 .. positions - 1``: each angle formed and reduced to [-pi, pi] in float64
    (as the kernels and ``rerotate_keys_`` do), then cos/sin in float32. The CPU tagged kernel's
    rotation table (``ragattn::_paged_attention_tagged_cpu``)."""
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq.detach().to("cpu", torch.float64)[None, :]
    ang = (ang - torch.round(ang * (0.5 / math.pi)) * (2 * math.pi)).float()
    return ang.cos(), ang.sin()


# inv_freq tensors' tables: id -> (weakref to it, its values, cos, sin). A request's layers and
# steps share one table (one per forward would cost more than the kernel's rotation at decode).
_ROPE_TABLES: dict = {}


_ROPE_TABLES_KEPT = 8


def rope_table(inv_freq: torch.Tensor, positions: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``rope_position_table`` of ``inv_freq`` with at least ``positions`` rows, kept for the
    tensor while its values are unchanged and grown by doubling (up to the maximum)."""
    hit = _ROPE_TABLES.get(id(inv_freq))
    if (hit is not None and hit[0]() is inv_freq and hit[2].shape[0] >= positions
            and torch.equal(hit[1], inv_freq.detach())):
        return hit[2], hit[3]
    have = hit[2].shape[0] if hit is not None and hit[0]() is inv_freq else 0
    cos, sin = rope_position_table(inv_freq, min(max(positions, 2 * have), ROPE_TABLE_MAX_POSITIONS))
    _ROPE_TABLES.pop(id(inv_freq), None)
    while len(_ROPE_TABLES) >= _ROPE_TABLES_KEPT:
        _ROPE_TABLES.pop(next(iter(_ROPE_TABLES)))
    _ROPE_TABLES[id(inv_freq)] = (weakref.ref(inv_freq), inv_freq.detach().clone(), cos, sin)
    return cos, sin


def padded_table(pages, row_start, kv_lens, page_size):
    """The CPU kernels' padded ``[B, max_used]`` table of a flat page list (entries past a
    sequence's used ones are clamped in range and never read)."""
    if row_start is None:
        return pages
    batch = kv_lens.shape[0]
    width = int(num_pages(kv_lens.long(), page_size).max()) if batch else 0
    if width == 0 or pages.shape[0] == 0:
        return pages.new_zeros((batch, 0))
    idx = row_start.long()[:, None] + torch.arange(width, device=pages.device)[None, :]
    return pages[idx.clamp(max=pages.shape[0] - 1)]


def into(out, lse_out, o, lse, dtype):
    if out is None:
        return o.to(dtype), lse.float()
    out.copy_(o)
    lse_out.copy_(lse)
    return out, lse_out


def run_on_backend(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0, launch, scale,
         window_left, entry_pos=None, entry_len=None, entry_start=None, inv_freq=None, rotary_dim=0, interleaved=False,
         k_scale=None, v_scale=None, logits_soft_cap=0.0, out=None, lse_out=None):
    """The run op on validated arguments, on the backend ``ragattn.ops.backend`` chooses: the Triton kernel
    with the plan; on the CPU the C++ kernels (the tagged one for position-tagged tables and
    page-local keys) or the reference, which need no plan."""
    chosen = backend.choose("paged_attention_run", q.device.type)
    if chosen == backend.TRITON:
        from ragattn.triton_kernels.paged_attention import run_paged_attention as run_tiles
        from ragattn.triton_kernels.paged_plan import PagedPlan

        plan = PagedPlan.from_launch(tile_seq, tile_row0, launch)
        with device_guard(q):
            return run_tiles(plan, q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, kv_lens, scale, window_left, out,
                             lse_out, row_start=row_start, entry_pos=entry_pos, entry_len=entry_len,
                             entry_start=entry_start,
                             inv_freq=inv_freq, rotary_dim=rotary_dim, interleaved=interleaved, k_scale=k_scale,
                             v_scale=v_scale, logits_soft_cap=logits_soft_cap)
    if k_scale is not None:
        # the caches dequantised as the kernel reads them (x * scale in fp32, then q's dtype)
        k_cache = (k_cache.to(torch.float32) * k_scale.reshape(())).to(q.dtype)
        v_cache = (v_cache.to(torch.float32) * v_scale.reshape(())).to(q.dtype)
    if not has_entries(entry_pos, entry_len, entry_start) and inv_freq is None:
        bt = padded_table(pages, row_start, kv_lens, k_cache.shape[1])
        if chosen == backend.CPP:
            return cpu_kernel(q, q_pos, cu_seqlens_q, k_cache, v_cache, bt, kv_lens, scale, window_left,
                               logits_soft_cap, out, lse_out)
        o, lse = _reference(q, q_pos, cu_seqlens_q, k_cache, v_cache, bt, kv_lens, scale, window_left,
                            logits_soft_cap=logits_soft_cap)
        return into(out, lse_out, o, lse, q.dtype)
    positions = int(q_pos.max()) + 1 if q_pos.numel() else 0
    if chosen == backend.REFERENCE or (inv_freq is not None and positions > ROPE_TABLE_MAX_POSITIONS):
        # (positions past the C++ kernel's table: the reference, same semantics, slower)
        from ragattn.reference.paged_attention_table import paged_attention_table

        o, lse = paged_attention_table(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens,
                                       entry_pos, entry_len, inv_freq, rotary_dim, interleaved, scale,
                                       window_left, logits_soft_cap, entry_start=entry_start)
        return into(out, lse_out, o, lse, q.dtype)
    # the C++ tagged kernel; its RoPE table covers every position a row can see
    if row_start is None:   # a padded [B, max_pages] table as a flat list
        row_start = torch.arange(pages.shape[0], dtype=torch.int64) * pages.shape[1]
        pages = pages.reshape(-1)
    cos = sin = None
    if inv_freq is not None:
        cos, sin = rope_table(inv_freq, positions)
    o, lse = torch.ops.ragattn._paged_attention_tagged_cpu(
        q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, entry_pos, entry_len, entry_start, cos,
        sin, rotary_dim if inv_freq is not None else 0, interleaved,
        scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), window_left, logits_soft_cap)
    return into(out, lse_out, o, lse, q.dtype)
