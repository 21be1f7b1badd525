"""``ragattn.plan_paged_attention`` / ``ragattn.run_paged_attention``: ``paged_attention`` planned
once per step over a ``ragattn.PageTable`` and run per layer (``torch.ops.ragattn.paged_attention_run``).

Its wrapper, checks, impls (the backend from ``paged_attention.kernel_backend``, the one choice
for both ops) and fakes, beside those of its private CPU kernel for position-tagged page lists
(``ragattn::_paged_attention_tagged_cpu``) and that kernel's RoPE table.
"""
from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch._subclasses.fake_tensor import is_fake

from ragattn.ops._direct_call import plain_cpu_call
from ragattn.ops._validate import FLOAT_DTYPES, INDEX_DTYPES, check_fp8_scale_values, check_tensor, device_guard
from ragattn.ops.page_table import PageTable
from ragattn.ops.paged_attention import (
    FP8_DTYPES,
    _cpu_kernel,
    _validate,
    call_out,
    kernel_backend,
    paged_attention,  # noqa: F401  (the op these plan and run)
)
from ragattn.reference.paged_attention import paged_attention as _reference

_RUN_OP = "paged_attention_run"
_TABLE_FIELDS = ("pages", "row_start", "kv_lens", "entry_pos", "entry_len", "entry_start")


@dataclass(frozen=True)
class PagedAttentionPlan:
    """A batch's launch plan for ``run_paged_attention`` (built by ``plan_paged_attention``).

    Attributes:
        table: the ``PageTable`` (pages, row starts, ``kv_lens``) the runs read.
        cu_seqlens_q: int32/int64 ``[B + 1]``, the query rows' offsets the plan was made for.
        tile_seq, tile_row0: int32 ``[num_tiles]`` on the device, the query tiles' sequence and
            first row counted from that sequence's start (``cu_seqlens_q[seq]`` is read at run time).
        launch: the kernel's host integers (tile sizes, GQA group, split-KV, warps, stages).
        window_left: the sliding window the plan was made for (-1: none).
        num_heads, num_kv_heads, head_dim, dtype: the attention shape it was made for.
        max_q_len: the bound it was planned for, if given (a sequence with more rows is an error).
    """

    table: PageTable
    cu_seqlens_q: torch.Tensor
    tile_seq: torch.Tensor
    tile_row0: torch.Tensor
    launch: Tuple[int, ...]
    window_left: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    max_q_len: Optional[int] = None  # given to plan_paged_attention (None: the exact rows at planning)


def _is_int(value) -> bool:
    """A Python int (bool excluded: ``True`` is not a split count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def plan_paged_attention(
    cu_seqlens_q: torch.Tensor,
    table: PageTable,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    window_left: int = -1,
    max_q_len: Optional[int] = None,
    max_kv_len: Optional[int] = None,
    num_splits: Optional[int] = None,
) -> PagedAttentionPlan:
    """Plan ``paged_attention`` for a batch once (per decode step); run it per layer with
    ``run_paged_attention``.

    Args:
        cu_seqlens_q: int32/int64 ``[B + 1]``, query row offsets (FlashInfer's ``qo_indptr``).
        table: the batch's ``PageTable`` (``PageTable.from_block_table`` or ``.from_csr``).
        num_heads, num_kv_heads, head_dim, dtype: q's heads, the caches' heads, the head size and
            q's dtype (fp16/bf16/fp32).
        window_left: the sliding window of every run (-1: none).
        max_q_len: the most query rows any sequence has; ``max_kv_len``: the most cached slots.
            Both given: nothing is read from the tensors (no host sync), so the plan can be made
            inside a captured CUDA graph, for the largest batch it will replay (FlashInfer's
            ``plan`` for a maximum). A missing one is read from the tensors (one host sync on CUDA).
        num_splits: forces the split-KV factor (default: from the SM count and the context).

    What a plan captures: the shapes of ``cu_seqlens_q`` and the table's tensors, and how many
    query tiles each sequence gets (``ceil(rows / block_m)`` of the rows at planning time, or of
    ``max_q_len`` for every sequence). Their contents are read at every run, so engines may update
    them in place between replays: sequence boundaries may move and contexts grow (exact: the last
    split-KV partition runs to the end) as long as no sequence has more query rows than its tiles
    cover; more is an error (ValueError "plan again"), checked on every CPU backend and, on CUDA,
    with ``RAGATTN_DEBUG=1`` (a check there would cost a host sync per layer).
    """
    from ragattn.triton_kernels.paged_attention import plan_paged_attention as plan_tiles

    if not isinstance(table, PageTable):
        raise TypeError(f"ragattn.plan_paged_attention: table must be a ragattn.PageTable, got {type(table).__name__}")
    check_tensor(_RUN_OP, "cu_seqlens_q", cu_seqlens_q, dtypes=INDEX_DTYPES, shape=(table.batch + 1,),
                 device=table.kv_lens.device)
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"ragattn.plan_paged_attention: {name} must be a positive int, got {value!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"ragattn.plan_paged_attention: num_heads ({num_heads}) must be a multiple of "
                         f"num_kv_heads ({num_kv_heads})")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"ragattn.plan_paged_attention: dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    for name, value in (("max_q_len", max_q_len), ("max_kv_len", max_kv_len)):
        if value is not None and (not _is_int(value) or value < 0):
            raise ValueError(f"ragattn.plan_paged_attention: {name} must be a non-negative int, got {value!r}")
    # checked here, not at run time: a plan is made once and run per layer
    if num_splits is not None and (not _is_int(num_splits) or num_splits < 1):
        raise ValueError(f"ragattn.plan_paged_attention: num_splits must be None (automatic) or a positive int, "
                         f"got {num_splits!r}")
    if not _is_int(window_left) or window_left > 2**31 - 1:
        raise ValueError(f"ragattn.plan_paged_attention: window_left must be an int (negative: no window) up to "
                         f"2^31 - 1, got {window_left!r}")
    p = plan_tiles(cu_seqlens_q, table.kv_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   dtype=dtype, window_left=window_left, num_splits=num_splits, max_q_len=max_q_len,
                   max_kv_len=max_kv_len)
    return PagedAttentionPlan(table, cu_seqlens_q, p.tile_seq, p.tile_row0, tuple(p.launch()), window_left,
                              num_heads, num_kv_heads, head_dim, dtype, max_q_len)


def run_paged_attention(
    plan: PagedAttentionPlan,
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: Optional[float] = None,
    *,
    inv_freq: Optional[torch.Tensor] = None,
    rotary_dim: Optional[int] = None,
    interleaved: bool = False,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    logits_soft_cap: float = 0.0,
    out: Optional[torch.Tensor] = None,
    lse_out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``paged_attention`` with a ready plan: no host sync on any device, CUDA-graph capturable,
    traceable by ``torch.compile(fullgraph=True)`` (``torch.ops.ragattn.paged_attention_run``).

    Args:
        plan: from ``plan_paged_attention`` (its page table and ``cu_seqlens_q`` are the run's).
        q: ``[total_q, num_heads, head_dim]`` in the plan's dtype; q_pos int32/int64 ``[total_q]``.
        k_cache, v_cache: ``[num_pages, page_size, num_kv_heads, head_dim]``, q's dtype (any
            strides with a unit last-dim stride).
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        inv_freq: float32 ``[rotary_dim // 2]`` (the model's RoPE frequencies, every HF scaling
            variant included): the caches hold keys *page-local*, slot ``o`` of every page rotated
            by ``o`` (a page is valid wherever a table places it), and the kernel moves each page to
            its entry's first position ``p0`` in fp32 (angles reduced in fp64), q arriving rotated
            as usual: the Triton kernel rotates each key tile by ``p0``, the CPU kernel the query by
            ``-p0`` once per entry (``R(m) q . R(p0 + o) k = R(m - p0) q . R(o) k``). ``rotary_dim`` (default head_dim, even, <= head_dim; partial rotary leaves the
            other dims as they are), ``interleaved`` (False: NeoX/HF halves, True: GPT-J pairs).
        k_scale, v_scale: float32 ``[]`` or ``[1]`` per-tensor scales of float8 caches (vLLM's
            ``kv_cache_dtype="fp8"``: ``float8_e4m3fn``, or ``float8_e5m2``): the kernel reads
            ``x * scale`` in fp32 and feeds the dot in q's dtype (fp16/bf16). Both or neither;
            required for float8 caches.
        logits_soft_cap: as in ``paged_attention`` (``> 0``: score -> cap * tanh(score / cap)).
        out, lse_out: optional outputs (``[total_q, num_heads, head_dim]`` in q's dtype, float32
            ``[total_q, num_heads]``; any strides; no overlap with an input).

    Returns (out, lse) exactly as ``paged_attention`` over the table's pages (same semantics,
    same non-finite rule), where a slot's position is its index, or with a position-tagged table
    (``PageTable.from_entries``) its entry's first position plus its offset; a row sees the
    valid slots at positions ``<= q_pos`` (and ``>= q_pos - window_left``). On CUDA index values are a precondition (checked with
    ``RAGATTN_DEBUG=1``); on CPU they are checked.
    """
    if not isinstance(plan, PagedAttentionPlan):
        raise TypeError(f"ragattn.run_paged_attention: plan must come from ragattn.plan_paged_attention, "
                        f"got {type(plan).__name__}")
    if q.dim() == 3 and (tuple(q.shape[1:]) != (plan.num_heads, plan.head_dim) or q.dtype != plan.dtype):
        raise ValueError(f"ragattn.run_paged_attention: q must be [*, {plan.num_heads}, {plan.head_dim}] "
                         f"{plan.dtype} as planned, got {tuple(q.shape)} {q.dtype}")
    if k_cache.dim() == 4 and k_cache.shape[2] != plan.num_kv_heads:
        raise ValueError(f"ragattn.run_paged_attention: k_cache must have {plan.num_kv_heads} kv heads as "
                         f"planned, got {k_cache.shape[2]}")
    t = plan.table
    rotary_dim = _rotary_dim(q, inv_freq, rotary_dim)
    _check_rows_within(plan.cu_seqlens_q, plan.max_q_len, q.device)
    args = (q, q_pos, plan.cu_seqlens_q, k_cache, v_cache, t.pages, t.row_start, t.kv_lens, plan.tile_seq,
            plan.tile_row0, list(plan.launch), scale, plan.window_left, t.entry_pos, t.entry_len, t.entry_start,
            inv_freq, rotary_dim or 0, bool(interleaved), k_scale, v_scale, float(logits_soft_cap))
    if out is None and lse_out is None:
        if (scale is None or type(scale) is float) and plain_cpu_call(q, q_pos, plan.cu_seqlens_q, k_cache, v_cache,
                                                                       *(getattr(t, f) for f in _TABLE_FIELDS),
                                                                       inv_freq, k_scale, v_scale):
            return _paged_attention_run_impl(*args)   # what torch.ops would run, without its dispatch
        return torch.ops.ragattn.paged_attention_run(*args)
    return call_out(torch.ops.ragattn.paged_attention_run.out, args, q, out, lse_out)


def _validate_run(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0,
                  launch, scale, window_left, entry_pos=None, entry_len=None, entry_start=None, inv_freq=None,
                  rotary_dim=0, interleaved=False, k_scale=None, v_scale=None, logits_soft_cap=0.0, out=None,
                  lse_out=None, *,
                  read_values=True, planned=True) -> None:
    """The run op's checks: ``_validate``'s on the table, the plan's tensors, the position-tagged
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

    _validate(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, kv_lens, scale, window_left, out, lse_out,
              read_values=read_values, row_start=row_start, kv_fp8=kv_fp8, logits_soft_cap=logits_soft_cap,
              _OP=_RUN_OP)
    dev = q.device
    if not planned:
        if read_values and dev.type == "cpu" and _has_entries(entry_pos, entry_len, entry_start):
            _check_entries(pages, entry_pos, entry_len, entry_start, k_cache.shape[1])
        return
    from ragattn.triton_kernels.paged_attention import LAUNCH_FIELDS

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
        if _has_entries(entry_pos, entry_len, entry_start):
            _check_entries(pages, entry_pos, entry_len, entry_start, k_cache.shape[1])
        block_m = int(launch[0])
        covered = torch.zeros(cu_seqlens_q.shape[0] - 1, dtype=torch.int64, device=dev)
        covered.index_add_(0, tile_seq.long(), torch.full_like(tile_seq, block_m, dtype=torch.int64))
        rows = cu_seqlens_q[1:].long() - cu_seqlens_q[:-1].long()
        if bool((rows > covered).any()):
            raise ValueError(f"ragattn.{_RUN_OP}: the plan covers {covered.tolist()} query rows per sequence, "
                             f"the batch has {rows.tolist()}: plan again (a larger max_q_len)")


def _rotary_dim(q: torch.Tensor, inv_freq, rotary_dim) -> Optional[int]:
    """``rotary_dim``, defaulting to head_dim with ``inv_freq``; without ``inv_freq`` (keys already
    rotated) a ``rotary_dim`` would be silently ignored: refused."""
    if inv_freq is None:
        if rotary_dim is not None:
            raise ValueError(f"ragattn.{_RUN_OP}: rotary_dim = {rotary_dim!r} is given without inv_freq: keys are "
                             "rotated in the kernel only with inv_freq (pass both, or neither for rotated keys)")
        return None
    return q.shape[-1] if rotary_dim is None else rotary_dim


def _check_rows_within(cu_seqlens_q: torch.Tensor, max_q_len: Optional[int], device: torch.device) -> None:
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


def _has_entries(entry_pos, entry_len, entry_start) -> bool:
    return entry_pos is not None or entry_len is not None or entry_start is not None


def _check_entries(pages, entry_pos, entry_len, entry_start, page_size) -> None:
    from ragattn.ops.page_table import _check_entry_values

    _check_entry_values(entry_pos if entry_pos is not None else pages.new_zeros(0),
                        entry_len if entry_len is not None else pages.new_zeros(0), page_size, entry_start)


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


def _rope_table(inv_freq: torch.Tensor, positions: int) -> Tuple[torch.Tensor, torch.Tensor]:
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


def _run_padded_table(pages, row_start, kv_lens, page_size):
    """The CPU kernels' padded ``[B, max_used]`` table of a flat page list (entries past a
    sequence's used ones are clamped in range and never read)."""
    if row_start is None:
        return pages
    batch = kv_lens.shape[0]
    width = int(((kv_lens.long() + page_size - 1) // page_size).max()) if batch else 0
    if width == 0 or pages.shape[0] == 0:
        return pages.new_zeros((batch, 0))
    idx = row_start.long()[:, None] + torch.arange(width, device=pages.device)[None, :]
    return pages[idx.clamp(max=pages.shape[0] - 1)]


def _into(out, lse_out, o, lse, dtype):
    if out is None:
        return o.to(dtype), lse.float()
    out.copy_(o)
    lse_out.copy_(lse)
    return out, lse_out


def _run(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0, launch, scale,
         window_left, entry_pos=None, entry_len=None, entry_start=None, inv_freq=None, rotary_dim=0, interleaved=False,
         k_scale=None, v_scale=None, logits_soft_cap=0.0, out=None, lse_out=None):
    """The run op on validated arguments, on the backend of ``kernel_backend``: the Triton kernel
    with the plan; on the CPU the C++ kernels (the tagged one for position-tagged tables and
    page-local keys) or the reference, which need no plan."""
    backend = kernel_backend(q)
    if backend == "triton":
        from ragattn.triton_kernels.paged_attention import PagedPlan, run_paged_attention as run_tiles

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
    if not _has_entries(entry_pos, entry_len, entry_start) and inv_freq is None:
        bt = _run_padded_table(pages, row_start, kv_lens, k_cache.shape[1])
        if backend == "cpu":
            return _cpu_kernel(q, q_pos, cu_seqlens_q, k_cache, v_cache, bt, kv_lens, scale, window_left,
                               logits_soft_cap, out, lse_out)
        o, lse = _reference(q, q_pos, cu_seqlens_q, k_cache, v_cache, bt, kv_lens, scale, window_left,
                            logits_soft_cap=logits_soft_cap)
        return _into(out, lse_out, o, lse, q.dtype)
    positions = int(q_pos.max()) + 1 if q_pos.numel() else 0
    if backend == "reference" or (inv_freq is not None and positions > ROPE_TABLE_MAX_POSITIONS):
        # (positions past the C++ kernel's table: the reference, same semantics, slower)
        from ragattn.reference.paged_attention_table import paged_attention_table

        o, lse = paged_attention_table(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens,
                                       entry_pos, entry_len, inv_freq, rotary_dim, interleaved, scale,
                                       window_left, logits_soft_cap, entry_start=entry_start)
        return _into(out, lse_out, o, lse, q.dtype)
    # the C++ tagged kernel; its RoPE table covers every position a row can see
    if row_start is None:   # a padded [B, max_pages] table as a flat list
        row_start = torch.arange(pages.shape[0], dtype=torch.int64) * pages.shape[1]
        pages = pages.reshape(-1)
    cos = sin = None
    if inv_freq is not None:
        cos, sin = _rope_table(inv_freq, positions)
    o, lse = torch.ops.ragattn._paged_attention_tagged_cpu(
        q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, entry_pos, entry_len, entry_start, cos,
        sin, rotary_dim if inv_freq is not None else 0, interleaved,
        scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), window_left, logits_soft_cap)
    return _into(out, lse_out, o, lse, q.dtype)


def _paged_attention_run_impl(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq,
                              tile_row0, launch, scale=None, window_left=-1, entry_pos=None, entry_len=None,
                              entry_start=None, inv_freq=None, rotary_dim=0, interleaved=False, k_scale=None,
                              v_scale=None, logits_soft_cap=0.0):
    a = (q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0, launch, scale,
         window_left, entry_pos, entry_len, entry_start, inv_freq, rotary_dim, interleaved, k_scale, v_scale,
         logits_soft_cap)
    _validate_run(*a)
    return _run(*a)


def _paged_attention_run_out_impl(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq,
                                  tile_row0, launch, scale=None, window_left=-1, entry_pos=None, entry_len=None,
                                  entry_start=None, inv_freq=None, rotary_dim=0, interleaved=False, k_scale=None,
                                  v_scale=None, logits_soft_cap=0.0, *, out, lse_out):
    a = (q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0, launch, scale,
         window_left, entry_pos, entry_len, entry_start, inv_freq, rotary_dim, interleaved, k_scale, v_scale,
         logits_soft_cap)
    _validate_run(*a, out, lse_out)
    _run(*a, out, lse_out)


torch.library.impl("ragattn::paged_attention_run", "CompositeExplicitAutograd", _paged_attention_run_impl)
torch.library.impl("ragattn::paged_attention_run.out", "CompositeExplicitAutograd", _paged_attention_run_out_impl)


@torch.library.register_fake("ragattn::_paged_attention_tagged_cpu")
def _paged_attention_tagged_cpu_fake(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, entry_pos,
                                     entry_len, entry_start, rope_cos, rope_sin, rotary_dim, interleaved, scale,
                                     window_left, logits_soft_cap):
    """The C++ op's checks that need no index values, in its order with its messages."""
    op = "ragattn._paged_attention_tagged_cpu"
    if not (q.dim() == 3 and k_cache.dim() == 4 and v_cache.shape == k_cache.shape and k_cache.shape[3] == q.shape[2]
            and k_cache.shape[2] >= 1 and q.shape[1] % k_cache.shape[2] == 0 and k_cache.shape[1] >= 1):
        raise ValueError(f"{op}: q [N, H, D] and k_cache, v_cache [pages, page_size, H_kv, D] with H_kv dividing H")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"{op}: q, k_cache and v_cache must share a dtype")
    batch = kv_lens.numel()
    for name, x, n in (("q_pos", q_pos, q.shape[0]), ("cu_seqlens_q", cu_seqlens_q, batch + 1),
                       ("kv_lens", kv_lens, batch), ("row_start", row_start, batch)):
        if x.dtype not in INDEX_DTYPES:
            raise TypeError(f"{op}: {name} must be int32 or int64")
        if x.dim() != 1 or x.shape[0] != n:
            raise ValueError(f"{op}: {name} must be a CPU [{n}] tensor")
    if pages.dim() != 1:
        raise ValueError(f"{op}: pages must be a flat page list")
    for name, x in (("pages", pages), ("entry_pos", entry_pos), ("entry_len", entry_len), ("entry_start", entry_start)):
        if x is not None and x.dtype not in INDEX_DTYPES:
            raise TypeError(f"{op}: {name} must be int32 or int64")
        if x is not None and (x.dim() != 1 or x.shape[0] != pages.shape[0]):
            raise ValueError(f"{op}: {name} must be a CPU [{pages.shape[0]}] tensor")
    if (rope_cos is None) != (rope_sin is None):
        raise ValueError(f"{op}: rope_cos and rope_sin go together")
    if rope_cos is not None:
        if not (2 <= rotary_dim <= q.shape[2] and rotary_dim % 2 == 0):
            raise ValueError(f"{op}: rotary_dim must be even and in [2, head_dim]")
        for x in (rope_cos, rope_sin):
            if not (x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == rotary_dim // 2 and x.is_contiguous()
                    and x.shape == rope_cos.shape):
                raise ValueError(f"{op}: rope_cos and rope_sin must be contiguous float32 [positions, rotary_dim / 2]")
    if not (math.isfinite(scale) and math.isfinite(logits_soft_cap) and logits_soft_cap >= 0):
        raise ValueError(f"{op}: scale finite, logits_soft_cap finite and >= 0")
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.register_fake("ragattn::paged_attention_run")
def _paged_attention_run_fake(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq,
                              tile_row0, launch, scale=None, window_left=-1, entry_pos=None, entry_len=None,
                              entry_start=None, inv_freq=None, rotary_dim=0, interleaved=False, k_scale=None,
                              v_scale=None, logits_soft_cap=0.0):
    _validate_run(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0, launch,
                  scale, window_left, entry_pos, entry_len, entry_start, inv_freq, rotary_dim, interleaved, k_scale,
                  v_scale, logits_soft_cap, read_values=False)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.register_fake("ragattn::paged_attention_run.out")
def _paged_attention_run_out_fake(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq,
                                  tile_row0, launch, scale=None, window_left=-1, entry_pos=None, entry_len=None,
                                  entry_start=None, inv_freq=None, rotary_dim=0, interleaved=False, k_scale=None,
                                  v_scale=None, logits_soft_cap=0.0, *, out, lse_out):
    _validate_run(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0, launch,
                  scale, window_left, entry_pos, entry_len, entry_start, inv_freq, rotary_dim, interleaved, k_scale,
                  v_scale, logits_soft_cap, out, lse_out, read_values=False)
