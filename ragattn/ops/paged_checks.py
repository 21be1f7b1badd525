"""The checks of the paged-attention ops (``paged_attention``, ``paged_attention_run``, and
``PagedAttentionStep``'s calls): metadata on every path (devices, dtypes, shapes, aliasing), index
values where they may be read (CPU, ``RAGATTN_DEBUG=1``), the plan's coverage of the query rows,
the position-tagged entries and the RoPE arguments. The fake impls validate through them too.

    validate(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left,
             out, lse_out, read_values=True, row_start=None, kv_fp8=False)   # the one-call op
    validate_run(*run_op_args, out, lse_out, read_values=True, planned=True)  # the run op
    cpu_well_formed(...)    # a fast sufficient condition for validate's metadata checks (CPU)
    check_rows_within(cu_seqlens_q, max_q_len, device); rotary_dim_of(q, inv_freq, rotary_dim)
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from ragattn.ops._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_cu_seqlens,
    check_fp8_scale_values,
    check_no_overlap,
    check_soft_cap,
    check_tensor,
)
from ragattn.ops import page_table

_OP = "paged_attention"
_RUN_OP = "paged_attention_run"

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # vLLM's kv_cache_dtype "fp8" / "fp8_e5m2"


def validate(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left,
              out=None, lse_out=None, *, read_values=True, row_start=None, kv_fp8=False, _OP=_OP,
              logits_soft_cap=0.0) -> None:
    """Every check of the op (CUDA path and fake impls). ``read_values=False`` (fake impl) skips the
    checks that read tensor contents; devices, dtypes, shapes and aliasing are checked on every path.
    The CPU's C++ kernel checks the index values itself as it reads them (``check_padded_values``
    in ``csrc/attention/paged_attention_cpu.cpp``: the same checks, its messages name the entry).
    With ``row_start`` (the run op's flat page list, ``ragattn.PageTable``), ``block_table`` is the
    flat ``pages`` ``[num_entries]``."""
    if out is None and lse_out is None and cpu_well_formed(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table,
                                                            kv_lens, row_start, scale, window_left, logits_soft_cap,
                                                            kv_fp8):
        # (every metadata check below passes: only the values are left; a CPU call per layer)
        if read_values:
            check_values(q_pos, cu_seqlens_q, block_table, kv_lens, row_start, k_cache.shape[1], k_cache.shape[0],
                          _OP)
        return
    check_tensor(_OP, "q", q, dtypes=FLOAT_DTYPES, ndim=3)
    dev = q.device
    total_q, num_heads, head_dim = q.shape
    if head_dim < 1:
        raise ValueError(f"ragattn.{_OP}: q's head_dim (dim 2) must be >= 1, got {head_dim}")
    check_tensor(_OP, "k_cache", k_cache, dtypes=FP8_DTYPES if kv_fp8 else (q.dtype,), ndim=4, device=dev)
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    check_tensor(_OP, "k_cache", k_cache, shape=(None, None, None, head_dim))
    check_tensor(_OP, "v_cache", v_cache, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape), device=dev)
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"ragattn.{_OP}: q's num_heads ({num_heads}) must be a multiple of k_cache's num_kv_heads ({num_kv_heads})"
        )
    if page_size < 1:
        raise ValueError(f"ragattn.{_OP}: k_cache's page_size (dim 1) must be >= 1, got {page_size}")
    check_tensor(_OP, "q_pos", q_pos, dtypes=INDEX_DTYPES, shape=(total_q,), device=dev)
    batch = check_cu_seqlens(_OP, "cu_seqlens_q", cu_seqlens_q, total_q, dev, dtypes=INDEX_DTYPES,
                             read_values=False)
    if row_start is None:
        check_tensor(_OP, "block_table", block_table, dtypes=INDEX_DTYPES, ndim=2, device=dev)
        check_tensor(_OP, "block_table", block_table, shape=(batch, None))
    else:
        check_tensor(_OP, "pages", block_table, dtypes=INDEX_DTYPES, ndim=1, device=dev)
        check_tensor(_OP, "row_start", row_start, dtypes=INDEX_DTYPES, shape=(batch,), device=dev)
    check_tensor(_OP, "kv_lens", kv_lens, dtypes=INDEX_DTYPES, shape=(batch,), device=dev)
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"ragattn.{_OP}: scale must be finite, got {scale}")
    if not isinstance(window_left, int):
        raise TypeError(f"ragattn.{_OP}: window_left must be an int, got {type(window_left).__name__}")
    check_soft_cap(_OP, logits_soft_cap)
    if out is not None or lse_out is not None:
        check_tensor(_OP, "out", out, dtypes=(q.dtype,), shape=tuple(q.shape), device=dev)
        check_tensor(_OP, "lse_out", lse_out, dtypes=(torch.float32,), shape=(total_q, num_heads), device=dev)
        check_no_overlap(_OP, {"out": out, "lse_out": lse_out},
                         dict(q=q, q_pos=q_pos, cu_seqlens_q=cu_seqlens_q, k_cache=k_cache, v_cache=v_cache,
                              kv_lens=kv_lens, row_start=row_start,
                              **{"block_table" if row_start is None else "pages": block_table}))
    # index checks would sync a GPU: there they are a precondition, checked when RAGATTN_DEBUG=1
    if read_values and dev.type != "meta" and (dev.type == "cpu" or os.environ.get("RAGATTN_DEBUG", "0") == "1"):
        check_values(q_pos, cu_seqlens_q, block_table, kv_lens, row_start, page_size, num_pages, _OP)


def cpu_well_formed(q, q_pos, cu, k, v, table, kv_lens, row_start, scale, window_left, soft_cap, kv_fp8) -> bool:
    """A fast sufficient condition for ``validate``'s metadata checks on plain CPU tensors; False
    only means "run the named checks" (which raise with the argument)."""
    T = torch.Tensor
    if not (type(q) is T and type(q_pos) is T and type(cu) is T and type(k) is T and type(v) is T
            and type(table) is T and type(kv_lens) is T and (row_start is None or type(row_start) is T)):
        return False
    if not (q.is_cpu and q_pos.is_cpu and cu.is_cpu and k.is_cpu and v.is_cpu and table.is_cpu and kv_lens.is_cpu
            and (row_start is None or row_start.is_cpu)):
        return False
    if kv_fp8 or q.dtype not in FLOAT_DTYPES or q.dim() != 3 or k.dim() != 4 or k.dtype != q.dtype:
        return False
    n, h, d = q.shape
    batch = cu.shape[0] - 1 if cu.dim() == 1 else -1
    return (v.dtype == q.dtype and v.shape == k.shape and k.shape[3] == d and d > 0 and k.shape[1] > 0
            and k.shape[2] > 0 and h % k.shape[2] == 0 and batch >= 0
            and q_pos.dtype in INDEX_DTYPES and q_pos.dim() == 1 and q_pos.shape[0] == n
            and cu.dtype in INDEX_DTYPES and kv_lens.dtype in INDEX_DTYPES and kv_lens.dim() == 1
            and kv_lens.shape[0] == batch and table.dtype in INDEX_DTYPES
            and (table.dim() == 2 and table.shape[0] == batch if row_start is None else
                 table.dim() == 1 and row_start.dtype in INDEX_DTYPES and row_start.dim() == 1
                 and row_start.shape[0] == batch)
            and (scale is None or (type(scale) is float and math.isfinite(scale))) and type(window_left) is int
            and type(soft_cap) is float and math.isfinite(soft_cap) and soft_cap >= 0)


def check_values(q_pos, cu_seqlens_q, block_table, kv_lens, row_start, page_size, num_pages, _OP=_OP) -> None:
    """The index-value checks of ``validate`` (a few reductions, one host read each): offsets,
    ``kv_lens``, ``q_pos`` and the table entries ``kv_lens`` uses."""
    dev, total_q, batch = q_pos.device, q_pos.shape[0], kv_lens.shape[0]
    check_cu_seqlens(_OP, "cu_seqlens_q", cu_seqlens_q.cpu(), total_q, torch.device("cpu"), dtypes=INDEX_DTYPES)
    if row_start is not None:
        check_page_list_values(block_table, row_start, kv_lens, q_pos, page_size, num_pages, _OP)
        return
    # few reductions, one host read each (this runs on every CPU call)
    max_pages = block_table.shape[1]
    if batch:
        lo, hi = (int(x) for x in torch.aminmax(kv_lens))
        if lo < 0 or hi > max_pages * page_size:
            raise ValueError(
                f"ragattn.{_OP}: kv_lens must lie in [0, max_pages * page_size = {max_pages * page_size}], "
                f"got {kv_lens.tolist()}"
            )
    if total_q and int(q_pos.min()) < 0:
        raise ValueError(f"ragattn.{_OP}: q_pos must be >= 0, got min {int(q_pos.min())}")
    if batch and max_pages:
        # pages used by kv_lens: the first ceil(kv_lens / page_size) of each row; others may be anything
        used = torch.arange(max_pages, device=dev)[None, :] * page_size < kv_lens[:, None]
        bad = used & ((block_table < 0) | (block_table >= num_pages))
        if bool(bad.any()):
            pages = block_table[used]
            raise ValueError(
                f"ragattn.{_OP}: block_table entries used by kv_lens must lie in [0, num_pages = {num_pages}), "
                f"got {int(pages.min())} .. {int(pages.max())}"
            )


def check_page_list_values(pages, row_start, kv_lens, q_pos, page_size, num_pages, op) -> None:
    """The value checks of a flat page list (``ragattn.PageTable`` with ``row_start``): each
    sequence's used entries ``row_start[b] .. row_start[b] + ceil(kv_lens[b] / page_size) - 1`` lie
    inside ``pages`` and name pages in ``[0, num_pages)``. A few reductions, one host read each."""
    batch = kv_lens.shape[0]
    if batch:
        used = page_table.num_pages(kv_lens.long(), page_size)   # (num_pages here: the cache's)
        lo_len, lo_start = int(kv_lens.min()), int(row_start.min())
        end = int((row_start.long() + used).max())
        if lo_len < 0 or lo_start < 0 or end > pages.shape[0]:
            raise ValueError(
                f"ragattn.{op}: every sequence's used entries (row_start .. row_start + ceil(kv_lens / "
                f"page_size) - 1) must lie in pages [0, {pages.shape[0]}) with kv_lens >= 0, got kv_lens "
                f"{kv_lens.tolist()}, row_start {row_start.tolist()}")
        width = int(used.max())
        if width:
            idx = row_start.long()[:, None] + torch.arange(width, device=pages.device)[None, :]
            mask = torch.arange(width, device=pages.device)[None, :] < used[:, None]
            vals = pages[idx.clamp(max=max(pages.shape[0] - 1, 0))][mask]
            if vals.numel() and (int(vals.min()) < 0 or int(vals.max()) >= num_pages):
                raise ValueError(
                    f"ragattn.{op}: pages used by kv_lens must lie in [0, num_pages = {num_pages}), "
                    f"got {int(vals.min())} .. {int(vals.max())}")
    if q_pos.numel() and int(q_pos.min()) < 0:
        raise ValueError(f"ragattn.{op}: q_pos must be >= 0, got min {int(q_pos.min())}")


def is_int(value) -> bool:
    """A Python int (bool excluded: ``True`` is not a split count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def validate_run(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0,
                  launch, scale, window_left, entry_pos=None, entry_len=None, entry_start=None, inv_freq=None,
                  rotary_dim=0, interleaved=False, k_scale=None, v_scale=None, logits_soft_cap=0.0, out=None,
                  lse_out=None, *,
                  read_values=True, planned=True) -> None:
    """The run op's checks: ``validate``'s on the table, the plan's tensors, the position-tagged
    entries and the RoPE arguments and, where values may be read (CPU, ``RAGATTN_DEBUG=1``), that
    the plan's tiles cover every query row (``planned=False``: a run with no plan, whose CPU
    kernel reads none: :class:`PagedAttentionStep`)."""
    kv_fp8 = k_scale is not None or v_scale is not None
    if kv_fp8:
        if k_scale is None or v_scale is None:
            raise ValueError(f"ragattn.{_RUN_OP}: k_scale and v_scale go together (float8 caches), got one")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            check_tensor(_RUN_OP, name, s, dtypes=(torch.float32,), device=q.device)
            if s.numel() != 1 or s.dim() > 1:
                raise ValueError(f"ragattn.{_RUN_OP}: {name} must be one per-tensor scale ([] or [1]), "
                                 f"got shape {tuple(s.shape)}")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"ragattn.{_RUN_OP}: q must be float16 or bfloat16 with float8 caches, got {q.dtype}")
        if read_values:   # finite and > 0 (kv_cache.py's rule; the kernel reads NaN for another)
            check_fp8_scale_values(_RUN_OP, "k_scale", k_scale)
            check_fp8_scale_values(_RUN_OP, "v_scale", v_scale)
    elif isinstance(k_cache, torch.Tensor) and k_cache.dtype in FP8_DTYPES:
        raise ValueError(f"ragattn.{_RUN_OP}: a {k_cache.dtype} cache needs k_scale and v_scale")
    for name, t in (("entry_pos", entry_pos), ("entry_len", entry_len), ("entry_start", entry_start)):
        if t is not None:
            if row_start is None:
                raise ValueError(f"ragattn.{_RUN_OP}: {name} needs a flat page list (row_start given)")
            check_tensor(_RUN_OP, name, t, dtypes=INDEX_DTYPES, shape=tuple(pages.shape), device=q.device)
    if inv_freq is not None:
        check_tensor(_RUN_OP, "inv_freq", inv_freq, dtypes=(torch.float32,), ndim=1, device=q.device)
        if not (isinstance(rotary_dim, int) and 2 <= rotary_dim <= q.shape[-1] and rotary_dim % 2 == 0):
            raise ValueError(f"ragattn.{_RUN_OP}: rotary_dim must be even and in [2, head_dim = {q.shape[-1]}], "
                             f"got {rotary_dim}")
        check_tensor(_RUN_OP, "inv_freq", inv_freq, shape=(rotary_dim // 2,))

    validate(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, kv_lens, scale, window_left, out, lse_out,
              read_values=read_values, row_start=row_start, kv_fp8=kv_fp8, logits_soft_cap=logits_soft_cap,
              _OP=_RUN_OP)
    dev = q.device
    if not planned:
        if read_values and dev.type == "cpu" and has_entries(entry_pos, entry_len, entry_start):
            check_entries(pages, entry_pos, entry_len, entry_start, k_cache.shape[1])
        return
    from ragattn.triton_kernels.paged_plan import LAUNCH_FIELDS

    check_tensor(_RUN_OP, "tile_seq", tile_seq, dtypes=(torch.int32,), ndim=1, device=dev)
    check_tensor(_RUN_OP, "tile_row0", tile_row0, dtypes=(torch.int32,), shape=tuple(tile_seq.shape), device=dev)
    if len(launch) != LAUNCH_FIELDS or any(int(x) < 0 for x in launch):
        raise ValueError(f"ragattn.{_RUN_OP}: launch must be the plan's {LAUNCH_FIELDS} non-negative ints "
                         f"(PagedAttentionPlan.launch), got {list(launch)}")
    group = q.shape[1] // max(k_cache.shape[2], 1)
    if int(launch[3]) != group:
        raise ValueError(f"ragattn.{_RUN_OP}: the plan was made for a GQA group of {launch[3]}, "
                         f"q and k_cache have {group}")
    if not read_values or dev.type == "meta":
        return
    if dev.type == "cpu" or os.environ.get("RAGATTN_DEBUG", "0") == "1":
        if has_entries(entry_pos, entry_len, entry_start):
            check_entries(pages, entry_pos, entry_len, entry_start, k_cache.shape[1])
        block_m = int(launch[0])
        covered = torch.zeros(cu_seqlens_q.shape[0] - 1, dtype=torch.int64, device=dev)
        covered.index_add_(0, tile_seq.long(), torch.full_like(tile_seq, block_m, dtype=torch.int64))
        rows = cu_seqlens_q[1:].long() - cu_seqlens_q[:-1].long()
        if bool((rows > covered).any()):
            raise ValueError(f"ragattn.{_RUN_OP}: the plan covers {covered.tolist()} query rows per sequence, "
                             f"the batch has {rows.tolist()}: plan again (a larger max_q_len)")


def rotary_dim_of(q: torch.Tensor, inv_freq, rotary_dim) -> Optional[int]:
    """``rotary_dim``, defaulting to head_dim with ``inv_freq``; without ``inv_freq`` (keys already
    rotated) a ``rotary_dim`` would be silently ignored: refused."""
    if inv_freq is None:
        if rotary_dim is not None:
            raise ValueError(f"ragattn.{_RUN_OP}: rotary_dim = {rotary_dim!r} is given without inv_freq: keys are "
                             "rotated in the kernel only with inv_freq (pass both, or neither for rotated keys)")
        return None
    return q.shape[-1] if rotary_dim is None else rotary_dim


def check_rows_within(cu_seqlens_q: torch.Tensor, max_q_len: Optional[int], device: torch.device) -> None:
    """A sequence with more query rows than the plan's ``max_q_len``: an error on every backend
    where values may be read (CPU, ``RAGATTN_DEBUG=1``), whatever its tiles happen to cover."""
    if (max_q_len is None or device.type == "meta" or cu_seqlens_q.numel() < 2 or torch.compiler.is_compiling()
            or is_fake(cu_seqlens_q)):
        return   # (traced, or fake tensors without values: the op's own impl still checks its tiles' coverage)
    if device.type == "cpu" or os.environ.get("RAGATTN_DEBUG", "0") == "1":
        rows = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        if rows > max_q_len:
            raise ValueError(f"ragattn.{_RUN_OP}: a sequence has {rows} query rows, more than the max_q_len = "
                             f"{max_q_len} planned for: plan again (a larger max_q_len)")


def has_entries(entry_pos, entry_len, entry_start) -> bool:
    return entry_pos is not None or entry_len is not None or entry_start is not None


def check_entries(pages, entry_pos, entry_len, entry_start, page_size) -> None:
    page_table._check_entry_values(entry_pos if entry_pos is not None else pages.new_zeros(0),
                                   entry_len if entry_len is not None else pages.new_zeros(0), page_size, entry_start)
