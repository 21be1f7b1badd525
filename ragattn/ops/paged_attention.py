"""``ragattn.paged_attention``: Q-indexed sparse prefill and decode over a paged KV cache."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ragattn import _extension
from ragattn.ops._validate import (
    check_soft_cap,
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_cu_seqlens,
    check_no_overlap,
    check_tensor,
    device_guard,
)
from ragattn.ops.page_table import PageTable
from ragattn.reference.paged_attention import paged_attention as _reference

_OP = "paged_attention"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # vLLM's kv_cache_dtype "fp8" / "fp8_e5m2"

# Forces the number of key-range partitions (split-KV) of the Triton kernel; unset or "auto"
# lets a heuristic choose (tests set it to compare split and unsplit results).
NUM_SPLITS_ENV = "RAGATTN_PAGED_NUM_SPLITS"


def _forced_num_splits() -> Optional[int]:
    value = os.environ.get(NUM_SPLITS_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    n = int(value)
    if n < 1:
        raise ValueError(f"ragattn.{_OP}: {NUM_SPLITS_ENV} must be a positive integer or 'auto', got {value!r}")
    return n


def _validate(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left,
              out=None, lse_out=None, *, read_values=True, row_start=None, kv_fp8=False, _OP=_OP,
              logits_soft_cap=0.0) -> None:
    """Every check of the op (CUDA path and fake impls). ``read_values=False`` (fake impl) skips the
    checks that read tensor contents; devices, dtypes, shapes and aliasing are checked on every path.
    The CPU impl makes the same checks in C++ (``check_paged_args`` in
    ``csrc/attention/paged_attention_cpu.cpp``), in this order with these messages: change both
    (tests/test_paged_attention.py compares them). With ``row_start`` (the run op's flat page
    list, ``ragattn.PageTable``), ``block_table`` is the flat ``pages`` ``[num_entries]``."""
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
                             read_values=read_values)
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
    if not read_values or dev.type == "meta":
        return
    if dev.type == "cpu" or os.environ.get("RAGATTN_DEBUG", "0") == "1":
        if row_start is not None:
            _check_page_list_values(block_table, row_start, kv_lens, q_pos, page_size, num_pages, _OP)
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


def _check_page_list_values(pages, row_start, kv_lens, q_pos, page_size, num_pages, op) -> None:
    """The value checks of a flat page list (``ragattn.PageTable`` with ``row_start``): each
    sequence's used entries ``row_start[b] .. row_start[b] + ceil(kv_lens[b] / page_size) - 1`` lie
    inside ``pages`` and name pages in ``[0, num_pages)``. A few reductions, one host read each."""
    batch = kv_lens.shape[0]
    if batch:
        used = (kv_lens.long() + page_size - 1) // page_size
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


def paged_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: Optional[float] = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    *,
    out: Optional[torch.Tensor] = None,
    lse_out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of any set of query rows, each at its own absolute position, over a paged KV cache.

    Args:
        q: ``[total_q, num_heads, head_dim]`` fp16/bf16/fp32, the query rows of all sequences packed.
        q_pos: int32 or int64 ``[total_q]``, the absolute position of each query row (>= 0; any
            value up to the dtype's maximum: a position past the cache sees every cached slot).
        cu_seqlens_q: int32 or int64 ``[B + 1]``, query row offsets per sequence (0 .. total_q).
        k_cache, v_cache: ``[num_pages, page_size, num_kv_heads, head_dim]``, q's dtype. Any page
            size; any strides with a unit last-dim stride (e.g. K and V as the two halves of
            FlashInfer's ``[pages, 2, page_size, H, D]`` cache: ``kv[:, 0]``, ``kv[:, 1]``, no copy).
        block_table: int32 or int64 ``[B, max_pages]``; slot ``j`` of sequence ``b`` lives at page
            ``block_table[b, j // page_size]``, offset ``j % page_size`` (pages in any order).
        kv_lens: int32 or int64 ``[B]``, cached slots per sequence, ``<= max_pages * page_size``.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        window_left: sliding window (FlashAttention's ``window_size=(window_left, -1)``, FlashInfer's
            ``window_left``): row ``i`` sees only slots ``j >= q_pos[i] - window_left``; negative
            (default -1) = no window. transformers' ``sliding_window = W`` (``kv_idx > q_idx - W``
            in ``masking_utils.sliding_window_overlay``) is ``window_left = W - 1``.
        logits_soft_cap: FlashInfer's name; ``> 0``: every score (after ``scale``, before the mask)
            becomes ``cap * tanh(score / cap)`` (Gemma 2's ``attn_logit_softcapping``); 0 (default):
            off. Finite and ``>= 0`` (ValueError otherwise).
        out, lse_out: optional preallocated outputs (``[total_q, num_heads, head_dim]`` in q's
            dtype, float32 ``[total_q, num_heads]``; any strides; must not overlap an input). The
            one given is written and returned; a missing one is allocated.

    Returns:
        out ``[total_q, num_heads, head_dim]`` in q's dtype, and lse float32 ``[total_q, num_heads]``
        (natural log). A row that sees no key gets out 0 and lse ``-inf`` (never NaN).

    Query row ``i`` of sequence ``b`` sees slot ``j`` iff ``j < kv_lens[b]`` and ``j <= q_pos[i]``
    and (``window_left < 0`` or ``j >= q_pos[i] - window_left``); slot ``j`` holds position ``j``.
    Query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``.
    ``x`` = visible, ``.`` = not visible, columns are slots ``0 .. kv_lens-1``::

        decode (one row at kv_lens-1)     final-block prefill (tail rows 6..8)
          q_pos=9  x x x x x x x x x x      q_pos=6  x x x x x x x . .
                                            q_pos=7  x x x x x x x x .
                                            q_pos=8  x x x x x x x x x

        scattered recompute (rows 1, 4, 6: causal by position, never the later slots)
          q_pos=1  x x . . . . . .
          q_pos=4  x x x x x . . .
          q_pos=6  x x x x x x x .

        speculative verification (gamma=2 draft tokens + 1 at slots 7..9, kv_lens=10)
          q_pos=7  x x x x x x x x . .
          q_pos=8  x x x x x x x x x .
          q_pos=9  x x x x x x x x x x

        sliding window, window_left=3 (each row sees itself and the 3 slots before it; HF W=4)
          q_pos=2  x x x . . . . . . .
          q_pos=6  . . . x x x x . . .
          q_pos=9  . . . . . . x x x x

    Non-finite values (one rule on every backend; the float64 reference over the visible slots is
    the truth): a slot a row does not see is never read into that row (a NaN or inf in V or K of
    a masked slot, a stale page slot past ``kv_lens``, or a slot left of the window changes
    nothing). A NaN or +inf visible score ``q . k`` makes that (row, head) NaN in out and lse; a
    ``-inf`` visible score has weight 0 (a row whose visible scores are all ``-inf`` gets out 0
    and lse ``-inf``: ``varlen_attention``'s rule, so the prefill and the decode of one cache
    agree); a non-finite ``v[j, d]`` of a visible slot makes ``out[i, h, d]`` NaN (never inf,
    never finite).

    Backends: CUDA runs the Triton kernel (Q tiles x kv heads, the GQA group stacked into each
    tile; key tiles right of a tile's largest q_pos or left of its window are never loaded;
    split-KV for few-row cases, forced with ``RAGATTN_PAGED_NUM_SPLITS=<n>``). The one-call path
    plans the launch from ``cu_seqlens_q`` and ``kv_lens`` (one host sync); engines that need a
    sync-free, CUDA-graph-capturable call use ``ragattn.triton_kernels.paged_attention``'s
    ``plan_paged_attention`` once per step and ``run_paged_attention`` per layer. CPU runs a C++
    kernel registered as the op's CPU impl, checks included (``csrc/attention/paged_attention_cpu.cpp``:
    per query row and kv head, the visible slots read in place through the page table, the GQA
    group's heads together, online softmax; no gather and no mask), the reference with ``RAGATTN_CPU_BACKEND=reference``, or the Triton
    kernel under the interpreter with ``RAGATTN_CPU_BACKEND=triton``. On
    CPU, out-of-range ``kv_lens``, ``q_pos`` and used ``block_table`` entries raise; on CUDA they
    are a precondition (checked when ``RAGATTN_DEBUG=1``).
    """
    if type(logits_soft_cap) is not float:   # (the schema would coerce or reject it unnamed)
        check_soft_cap(_OP, logits_soft_cap)
    if out is None and lse_out is None:
        return torch.ops.ragattn.paged_attention(
            q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left, float(logits_soft_cap)
        )
    if out is None:
        out = q.new_empty(q.shape)
    if lse_out is None:
        lse_out = q.new_empty(q.shape[:2], dtype=torch.float32)
    torch.ops.ragattn.paged_attention.out(
        q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left, float(logits_soft_cap),
        out=out, lse_out=lse_out
    )
    return out, lse_out


def _triton(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left, out=None, lse_out=None,
            logits_soft_cap=0.0):
    from ragattn.triton_kernels.paged_attention import paged_attention_fwd

    return paged_attention_fwd(
        q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left,
        num_splits=_forced_num_splits(), out=out, lse_out=lse_out, logits_soft_cap=logits_soft_cap,
    )


@torch.library.impl("ragattn::_paged_attention_cpu_backend", "CPU")
def _cpu_backend(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left,
                 logits_soft_cap=0.0):
    """``RAGATTN_CPU_BACKEND=reference|triton``: called by the op's C++ CPU impl
    (``csrc/attention/paged_attention_cpu.cpp``) after its checks (``_validate``'s, in C++)."""
    backend = _extension.cpu_backend()  # raises on a value that is not a backend
    if backend == "triton":
        return _triton(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left,
                       logits_soft_cap=logits_soft_cap)
    if backend != "reference":
        raise RuntimeError(f"ragattn.{_OP}: the C++ CPU impl runs backend {backend!r} itself")
    return _reference(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left,
                      logits_soft_cap=logits_soft_cap)


def _cuda(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left, out=None, lse_out=None,
          logits_soft_cap=0.0):
    _validate(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left, out, lse_out,
              logits_soft_cap=logits_soft_cap)
    with device_guard(q):
        return _triton(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left, out, lse_out,
                       logits_soft_cap)


@torch.library.impl("ragattn::paged_attention", "CUDA")
def _paged_attention_cuda(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale=None, window_left=-1,
                          logits_soft_cap=0.0):
    return _cuda(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left,
                 logits_soft_cap=logits_soft_cap)


@torch.library.impl("ragattn::paged_attention.out", "CUDA")
def _paged_attention_out_cuda(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale=None,
                              window_left=-1, logits_soft_cap=0.0, *, out, lse_out):
    _cuda(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left, out, lse_out,
          logits_soft_cap)


@torch.library.register_fake("ragattn::paged_attention")
def _paged_attention_fake(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale=None, window_left=-1,
                          logits_soft_cap=0.0):
    _validate(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left, read_values=False,
              logits_soft_cap=logits_soft_cap)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)  # contiguous, like the kernels


@torch.library.register_fake("ragattn::paged_attention.out")
def _paged_attention_out_fake(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale=None,
                              window_left=-1, logits_soft_cap=0.0, *, out, lse_out):
    _validate(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left, out, lse_out,
              read_values=False, logits_soft_cap=logits_soft_cap)


# ------------------------------------------------------------------- plan once, run per layer

_RUN_OP = "paged_attention_run"


@dataclass(frozen=True)
class PagedAttentionPlan:
    """A batch's launch plan for ``run_paged_attention`` (built by ``plan_paged_attention``).

    Attributes:
        table: the ``PageTable`` (pages, row starts, ``kv_lens``) the runs read.
        cu_seqlens_q: int32/int64 ``[B + 1]``, the query rows' offsets the plan was made for.
        tile_seq, tile_row0: int32 ``[num_tiles]`` on the device, the query tiles' sequence and
            first row.
        launch: the kernel's host integers (tile sizes, GQA group, split-KV, warps, stages).
        window_left: the sliding window the plan was made for (-1: none).
        num_heads, num_kv_heads, head_dim, dtype: the attention shape it was made for.
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

    A plan stays valid while ``cu_seqlens_q`` and the table's tensors keep their shapes: engines
    update their contents in place between replays (longer contexts stay exact, the last split-KV
    partition runs to the end; a sequence with more than ``max_q_len`` rows is an error, checked on
    CPU and with ``RAGATTN_DEBUG=1``).
    """
    from ragattn.triton_kernels.paged_attention import plan_paged_attention as plan_tiles

    if not isinstance(table, PageTable):
        raise TypeError(f"ragattn.plan_paged_attention: table must be a ragattn.PageTable, got {type(table).__name__}")
    check_tensor(_RUN_OP, "cu_seqlens_q", cu_seqlens_q, dtypes=INDEX_DTYPES, shape=(table.batch + 1,),
                 device=table.kv_lens.device)
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"ragattn.plan_paged_attention: {name} must be a positive int, got {value!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"ragattn.plan_paged_attention: num_heads ({num_heads}) must be a multiple of "
                         f"num_kv_heads ({num_kv_heads})")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"ragattn.plan_paged_attention: dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    for name, value in (("max_q_len", max_q_len), ("max_kv_len", max_kv_len)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"ragattn.plan_paged_attention: {name} must be a non-negative int, got {value!r}")
    p = plan_tiles(cu_seqlens_q, table.kv_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   dtype=dtype, window_left=window_left, num_splits=num_splits, max_q_len=max_q_len,
                   max_kv_len=max_kv_len)
    return PagedAttentionPlan(table, cu_seqlens_q, p.tile_seq, p.tile_row0, tuple(p.launch()), window_left,
                              num_heads, num_kv_heads, head_dim, dtype)


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
            variant included): the caches hold keys *without* RoPE and the kernel rotates each
            key tile by its slots' positions in fp32 (angles reduced in fp64), q arriving rotated
            as usual. ``rotary_dim`` (default head_dim, even, <= head_dim; partial rotary leaves the
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
    if inv_freq is not None and rotary_dim is None:
        rotary_dim = q.shape[-1]
    args = (q, q_pos, plan.cu_seqlens_q, k_cache, v_cache, t.pages, t.row_start, t.kv_lens, plan.tile_seq,
            plan.tile_row0, list(plan.launch), scale, plan.window_left, t.entry_pos, t.entry_len, inv_freq,
            rotary_dim or 0, bool(interleaved), k_scale, v_scale, float(logits_soft_cap))
    if out is None and lse_out is None:
        return torch.ops.ragattn.paged_attention_run(*args)
    if out is None:
        out = q.new_empty(q.shape)
    if lse_out is None:
        lse_out = q.new_empty(q.shape[:2], dtype=torch.float32)
    torch.ops.ragattn.paged_attention_run.out(*args, out=out, lse_out=lse_out)
    return out, lse_out


def _validate_run(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0,
                  launch, scale, window_left, entry_pos=None, entry_len=None, inv_freq=None, rotary_dim=0,
                  interleaved=False, k_scale=None, v_scale=None, logits_soft_cap=0.0, out=None, lse_out=None, *,
                  read_values=True) -> None:
    """The run op's checks: ``_validate``'s on the table, the plan's tensors, the position-tagged
    entries and the RoPE arguments and, where values may be read (CPU, ``RAGATTN_DEBUG=1``), that
    the plan's tiles cover every query row."""
    from ragattn.triton_kernels.paged_attention import LAUNCH_FIELDS

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
    elif isinstance(k_cache, torch.Tensor) and k_cache.dtype in FP8_DTYPES:
        raise ValueError(f"ragattn.{_RUN_OP}: a {k_cache.dtype} cache needs k_scale and v_scale")
    for name, t in (("entry_pos", entry_pos), ("entry_len", entry_len)):
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
        if entry_pos is not None or entry_len is not None:
            from ragattn.ops.page_table import _check_entry_values

            _check_entry_values(entry_pos if entry_pos is not None else pages.new_zeros(0),
                                entry_len if entry_len is not None else pages.new_zeros(0), k_cache.shape[1])
        block_m = int(launch[0])
        covered = torch.zeros(cu_seqlens_q.shape[0] - 1, dtype=torch.int64, device=dev)
        covered.index_add_(0, tile_seq.long(), torch.full_like(tile_seq, block_m, dtype=torch.int64))
        rows = cu_seqlens_q[1:].long() - cu_seqlens_q[:-1].long()
        if bool((rows > covered).any()):
            raise ValueError(f"ragattn.{_RUN_OP}: the plan covers {covered.tolist()} query rows per sequence, "
                             f"the batch has {rows.tolist()}: plan again (a larger max_q_len)")


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


def _run(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0, launch, scale,
         window_left, entry_pos=None, entry_len=None, inv_freq=None, rotary_dim=0, interleaved=False, k_scale=None,
         v_scale=None, logits_soft_cap=0.0, out=None, lse_out=None):
    from ragattn.triton_kernels.paged_attention import PagedPlan, run_paged_attention as run_tiles

    if k_scale is not None and q.device.type == "cpu" and _extension.cpu_backend() != "triton":
        # CPU: the caches dequantised as the kernel reads them (x * scale in fp32, then q's dtype)
        k_cache = (k_cache.to(torch.float32) * k_scale.reshape(())).to(q.dtype)
        v_cache = (v_cache.to(torch.float32) * v_scale.reshape(())).to(q.dtype)
        k_scale = v_scale = None
    tagged = entry_pos is not None or entry_len is not None or inv_freq is not None
    if q.device.type == "cpu" and tagged and _extension.cpu_backend() != "triton":
        positions = int(q_pos.max()) + 1 if q_pos.numel() else 0
        if _extension.cpu_backend() == "reference" or (inv_freq is not None and positions > ROPE_TABLE_MAX_POSITIONS):
            # (positions past the C++ kernel's table: the reference, same semantics, slower)
            from ragattn.reference.paged_attention_table import paged_attention_table

            o, lse = paged_attention_table(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens,
                                           entry_pos, entry_len, inv_freq, rotary_dim, interleaved, scale,
                                           window_left, logits_soft_cap)
        else:
            # the C++ tagged kernel; its RoPE table covers every position a row can see
            if row_start is None:   # a padded [B, max_pages] table as a flat list
                row_start = torch.arange(pages.shape[0], dtype=torch.int64) * pages.shape[1]
                pages = pages.reshape(-1)
            cos = sin = None
            if inv_freq is not None:
                cos, sin = rope_position_table(inv_freq, positions)
            o, lse = torch.ops.ragattn._paged_attention_tagged_cpu(
                q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, entry_pos, entry_len, cos, sin,
                rotary_dim if inv_freq is not None else 0, interleaved,
                scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), window_left, logits_soft_cap)
        if out is None:
            return o.to(q.dtype), lse.float()
        out.copy_(o)
        lse_out.copy_(lse)
        return out, lse_out
    if q.device.type == "cpu" and _extension.cpu_backend() != "triton":
        # CPU: the C++ kernel (or the reference) over the equivalent padded table
        bt = _run_padded_table(pages, row_start, kv_lens, k_cache.shape[1])
        if out is None:
            return paged_attention(q, q_pos, cu_seqlens_q, k_cache, v_cache, bt, kv_lens, scale, window_left,
                                   logits_soft_cap)
        return paged_attention(q, q_pos, cu_seqlens_q, k_cache, v_cache, bt, kv_lens, scale, window_left,
                               logits_soft_cap, out=out, lse_out=lse_out)
    plan = PagedPlan.from_launch(tile_seq, tile_row0, launch)
    with device_guard(q):
        return run_tiles(plan, q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, kv_lens, scale, window_left, out,
                         lse_out, row_start=row_start, entry_pos=entry_pos, entry_len=entry_len, inv_freq=inv_freq,
                         rotary_dim=rotary_dim, interleaved=interleaved, k_scale=k_scale, v_scale=v_scale,
                         logits_soft_cap=logits_soft_cap)


@torch.library.impl("ragattn::paged_attention_run", "CompositeExplicitAutograd")
def _paged_attention_run_impl(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq,
                              tile_row0, launch, scale=None, window_left=-1, entry_pos=None, entry_len=None,
                              inv_freq=None, rotary_dim=0, interleaved=False, k_scale=None, v_scale=None,
                              logits_soft_cap=0.0):
    a = (q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0, launch, scale,
         window_left, entry_pos, entry_len, inv_freq, rotary_dim, interleaved, k_scale, v_scale, logits_soft_cap)
    _validate_run(*a)
    return _run(*a)


@torch.library.impl("ragattn::paged_attention_run.out", "CompositeExplicitAutograd")
def _paged_attention_run_out_impl(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq,
                                  tile_row0, launch, scale=None, window_left=-1, entry_pos=None, entry_len=None,
                                  inv_freq=None, rotary_dim=0, interleaved=False, k_scale=None, v_scale=None,
                                  logits_soft_cap=0.0, *, out, lse_out):
    a = (q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0, launch, scale,
         window_left, entry_pos, entry_len, inv_freq, rotary_dim, interleaved, k_scale, v_scale, logits_soft_cap)
    _validate_run(*a, out, lse_out)
    _run(*a, out, lse_out)


@torch.library.register_fake("ragattn::_paged_attention_tagged_cpu")
def _paged_attention_tagged_cpu_fake(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, entry_pos,
                                     entry_len, rope_cos, rope_sin, rotary_dim, interleaved, scale, window_left,
                                     logits_soft_cap):
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
    for name, x in (("pages", pages), ("entry_pos", entry_pos), ("entry_len", entry_len)):
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
                              inv_freq=None, rotary_dim=0, interleaved=False, k_scale=None, v_scale=None,
                              logits_soft_cap=0.0):
    _validate_run(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0, launch,
                  scale, window_left, entry_pos, entry_len, inv_freq, rotary_dim, interleaved, k_scale, v_scale,
                  logits_soft_cap, read_values=False)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.register_fake("ragattn::paged_attention_run.out")
def _paged_attention_run_out_fake(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq,
                                  tile_row0, launch, scale=None, window_left=-1, entry_pos=None, entry_len=None,
                                  inv_freq=None, rotary_dim=0, interleaved=False, k_scale=None, v_scale=None,
                                  logits_soft_cap=0.0, *, out, lse_out):
    _validate_run(q, q_pos, cu_seqlens_q, k_cache, v_cache, pages, row_start, kv_lens, tile_seq, tile_row0, launch,
                  scale, window_left, entry_pos, entry_len, inv_freq, rotary_dim, interleaved, k_scale, v_scale,
                  logits_soft_cap, out, lse_out, read_values=False)
