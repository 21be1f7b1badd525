"""``ragattn.plan_paged_attention`` / ``ragattn.run_paged_attention``: ``paged_attention`` planned
once per step over a ``ragattn.PageTable`` and run per layer (``torch.ops.ragattn.paged_attention_run``).

Its wrappers, impls and fakes, beside the fake of its private CPU kernel for position-tagged page
lists (``ragattn::_paged_attention_tagged_cpu``). Checks: ``ragattn.ops.paged_checks``; backends:
``ragattn.ops.paged_kernels`` (chosen by ``ragattn.ops.backend``); the tile planner:
``ragattn.triton_kernels.paged_plan``.

    plan = plan_paged_attention(cu_seqlens_q, table, num_heads=H, num_kv_heads=Hk, head_dim=D,
                                dtype=q.dtype, window_left=-1, max_q_len=None, max_kv_len=None)
    out, lse = run_paged_attention(plan, q, q_pos, k_cache, v_cache, scale=None, inv_freq=None, ...)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ragattn.ops._direct_call import plain_cpu_call
from ragattn.ops._validate import FLOAT_DTYPES, INDEX_DTYPES, check_tensor
from ragattn.ops.page_table import PageTable
from ragattn.ops.paged_checks import check_rows_within, is_int, rotary_dim_of, validate_run
from ragattn.ops.paged_kernels import call_out, run_on_backend

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
    from ragattn.triton_kernels.paged_plan import plan_paged_attention as plan_tiles

    if not isinstance(table, PageTable):
        raise TypeError(f"ragattn.plan_paged_attention: table must be a ragattn.PageTable, got {type(table).__name__}")
    check_tensor(_RUN_OP, "cu_seqlens_q", cu_seqlens_q, dtypes=INDEX_DTYPES, shape=(table.batch + 1,),
                 device=table.kv_lens.device)
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not is_int(value) or value < 1:
            raise ValueError(f"ragattn.plan_paged_attention: {name} must be a positive int, got {value!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"ragattn.plan_paged_attention: num_heads ({num_heads}) must be a multiple of "
                         f"num_kv_heads ({num_kv_heads})")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"ragattn.plan_paged_attention: dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    for name, value in (("max_q_len", max_q_len), ("max_kv_len", max_kv_len)):
        if value is not None and (not is_int(value) or value < 0):
            raise ValueError(f"ragattn.plan_paged_attention: {name} must be a non-negative int, got {value!r}")
    # checked here, not at run time: a plan is made once and run per layer
    if num_splits is not None and (not is_int(num_splits) or num_splits < 1):
        raise ValueError(f"ragattn.plan_paged_attention: num_splits must be None (automatic) or a positive int, "
                         f"got {num_splits!r}")
    if not is_int(window_left) or window_left > 2**31 - 1:
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
    rotary_dim = rotary_dim_of(q, inv_freq, rotary_dim)
    check_rows_within(plan.cu_seqlens_q, plan.max_q_len, q.device)
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


def _paged_attention_run_impl(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq,
                              tile_row0, launch, scale=None, window_left=-1, entry_pos=None, entry_len=None,
                              entry_start=None, inv_freq=None, rotary_dim=0, interleaved=False, k_scale=None,
                              v_scale=None, logits_soft_cap=0.0):
    a = (q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0, launch, scale,
         window_left, entry_pos, entry_len, entry_start, inv_freq, rotary_dim, interleaved, k_scale, v_scale,
         logits_soft_cap)
    validate_run(*a)
    return run_on_backend(*a)


def _paged_attention_run_out_impl(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq,
                                  tile_row0, launch, scale=None, window_left=-1, entry_pos=None, entry_len=None,
                                  entry_start=None, inv_freq=None, rotary_dim=0, interleaved=False, k_scale=None,
                                  v_scale=None, logits_soft_cap=0.0, *, out, lse_out):
    a = (q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0, launch, scale,
         window_left, entry_pos, entry_len, entry_start, inv_freq, rotary_dim, interleaved, k_scale, v_scale,
         logits_soft_cap)
    validate_run(*a, out, lse_out)
    run_on_backend(*a, out, lse_out)


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
    validate_run(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0, launch,
                  scale, window_left, entry_pos, entry_len, entry_start, inv_freq, rotary_dim, interleaved, k_scale,
                  v_scale, logits_soft_cap, read_values=False)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.register_fake("ragattn::paged_attention_run.out")
def _paged_attention_run_out_fake(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq,
                                  tile_row0, launch, scale=None, window_left=-1, entry_pos=None, entry_len=None,
                                  entry_start=None, inv_freq=None, rotary_dim=0, interleaved=False, k_scale=None,
                                  v_scale=None, logits_soft_cap=0.0, *, out, lse_out):
    validate_run(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0, launch,
                  scale, window_left, entry_pos, entry_len, entry_start, inv_freq, rotary_dim, interleaved, k_scale,
                  v_scale, logits_soft_cap, out, lse_out, read_values=False)
