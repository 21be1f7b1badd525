"""``ragattn.paged_attention``: Q-indexed sparse prefill and decode over a paged KV cache.

The one-call op: its wrapper, checks, impls (one dispatch point: :func:`kernel_backend`) and
fakes. The plan/run pair over a ``PageTable`` is ``ragattn.ops.paged_attention_run``."""
from __future__ import annotations

import math
import os
from typing import Optional, Tuple

import torch

from ragattn import _extension
from ragattn.ops._direct_call import plain_cpu_call
from ragattn.ops._validate import (
    check_soft_cap,
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_cu_seqlens,
    check_no_overlap,
    check_tensor,
    device_guard,
)
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
    The CPU's C++ kernel checks the index values itself as it reads them (``check_padded_values``
    in ``csrc/attention/paged_attention_cpu.cpp``: the same checks, its messages name the entry).
    With ``row_start`` (the run op's flat page list, ``ragattn.PageTable``), ``block_table`` is the
    flat ``pages`` ``[num_entries]``."""
    if out is None and lse_out is None and _cpu_well_formed(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table,
                                                            kv_lens, row_start, scale, window_left, logits_soft_cap,
                                                            kv_fp8):
        # (every metadata check below passes: only the values are left; a CPU call per layer)
        if read_values:
            _check_values(q_pos, cu_seqlens_q, block_table, kv_lens, row_start, k_cache.shape[1], k_cache.shape[0],
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
        _check_values(q_pos, cu_seqlens_q, block_table, kv_lens, row_start, page_size, num_pages, _OP)


def _cpu_well_formed(q, q_pos, cu, k, v, table, kv_lens, row_start, scale, window_left, soft_cap, kv_fp8) -> bool:
    """A fast sufficient condition for ``_validate``'s metadata checks on plain CPU tensors; False
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


def _check_values(q_pos, cu_seqlens_q, block_table, kv_lens, row_start, page_size, num_pages, _OP=_OP) -> None:
    """The index-value checks of ``_validate`` (a few reductions, one host read each): offsets,
    ``kv_lens``, ``q_pos`` and the table entries ``kv_lens`` uses."""
    dev, total_q, batch = q_pos.device, q_pos.shape[0], kv_lens.shape[0]
    check_cu_seqlens(_OP, "cu_seqlens_q", cu_seqlens_q.cpu(), total_q, torch.device("cpu"), dtypes=INDEX_DTYPES)
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
    sync-free, CUDA-graph-capturable call use ``ragattn.plan_paged_attention`` once per step and
    ``ragattn.run_paged_attention`` per layer. CPU runs a C++
    kernel (``csrc/attention/paged_attention_cpu.cpp``: per query row and kv head, the visible
    slots read in place through the page table, the GQA group's heads together, online softmax;
    no gather and no mask), the reference with ``RAGATTN_CPU_BACKEND=reference``, or the Triton
    kernel under the interpreter with ``RAGATTN_CPU_BACKEND=triton`` (:func:`kernel_backend`). On
    CPU, out-of-range ``kv_lens``, ``q_pos`` and used ``block_table`` entries raise; on CUDA they
    are a precondition (checked when ``RAGATTN_DEBUG=1``).
    """
    if type(logits_soft_cap) is not float:   # (the schema would coerce or reject it unnamed)
        check_soft_cap(_OP, logits_soft_cap)
    args = (q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left, float(logits_soft_cap))
    if (out is None and lse_out is None and (scale is None or type(scale) is float) and type(window_left) is int
            and plain_cpu_call(*args[:7])):
        return _paged_attention_impl(*args)   # what torch.ops would run, without its dispatch
    if out is None and lse_out is None:
        return torch.ops.ragattn.paged_attention(*args)
    return call_out(torch.ops.ragattn.paged_attention.out, args, q, out, lse_out)


def call_out(op_out, args, q, out, lse_out):
    """``op_out(*args, out=, lse_out=)`` with the missing one of ``out`` / ``lse_out`` allocated
    (``[total_q, H, D]`` in q's dtype, float32 ``[total_q, H]``); returns both."""
    if out is None:
        out = q.new_empty(q.shape)
    if lse_out is None:
        lse_out = q.new_empty(q.shape[:2], dtype=torch.float32)
    op_out(*args, out=out, lse_out=lse_out)
    return out, lse_out



# ------------------------------------------------------------------- the one dispatch point

def kernel_backend(q: torch.Tensor) -> str:
    """Which kernel runs ``paged_attention`` and ``run_paged_attention`` for ``q``'s device (the
    one place this is decided): ``"triton"`` on CUDA, and on the CPU with
    ``RAGATTN_CPU_BACKEND=triton`` (the interpreter); ``"reference"`` with
    ``RAGATTN_CPU_BACKEND=reference``; ``"cpu"`` otherwise (the C++ kernels of
    ``csrc/attention/paged_attention_cpu.cpp``). ``RAGATTN_CPU_BACKEND`` is read on every call."""
    if q.device.type != "cpu":
        return "triton"
    backend = _extension.cpu_backend()  # raises on a value that is not a backend
    return backend if backend in ("triton", "reference") else "cpu"


def _default_scale(scale, head_dim: int) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


def _cpu_kernel(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left, logits_soft_cap,
                out=None, lse_out=None):
    """The C++ kernel over a padded ``block_table`` (``ragattn::_paged_attention_cpu``), on
    validated metadata; it checks the index values it follows itself."""
    if out is None:
        out = q.new_empty(q.shape)                                  # contiguous, like the fake impl
        lse_out = q.new_empty(q.shape[:2], dtype=torch.float32)
    torch.ops.ragattn._paged_attention_cpu(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens,
                                           _default_scale(scale, q.shape[-1]), window_left, float(logits_soft_cap),
                                           out=out, lse_out=lse_out)
    return out, lse_out


def _triton(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left, out=None, lse_out=None,
            logits_soft_cap=0.0):
    from ragattn.triton_kernels.paged_attention import paged_attention_fwd

    with device_guard(q):
        return paged_attention_fwd(
            q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left,
            num_splits=_forced_num_splits(), out=out, lse_out=lse_out, logits_soft_cap=logits_soft_cap,
        )


def _paged_attention_impl(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale=None, window_left=-1,
                          logits_soft_cap=0.0, out=None, lse_out=None):
    """``torch.ops.ragattn.paged_attention`` (and ``.out``) on CPU and CUDA: every check, then the
    backend of :func:`kernel_backend`."""
    args = (q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left)
    _validate(*args, out, lse_out, read_values=False, logits_soft_cap=logits_soft_cap)
    backend = kernel_backend(q)
    if backend == "cpu":   # (the C++ kernel reads and checks the index values in one pass)
        return _cpu_kernel(*args, logits_soft_cap, out, lse_out)
    if q.device.type == "cpu" or os.environ.get("RAGATTN_DEBUG", "0") == "1":   # (a GPU precondition)
        _check_values(q_pos, cu_seqlens_q, block_table, kv_lens, None, k_cache.shape[1], k_cache.shape[0])
    if backend == "triton":
        return _triton(*args, out, lse_out, logits_soft_cap)
    o, lse = _reference(*args, logits_soft_cap=logits_soft_cap)
    if out is None:
        return o, lse
    out.copy_(o)
    lse_out.copy_(lse)
    return out, lse_out


def _paged_attention_out_impl(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale=None,
                              window_left=-1, logits_soft_cap=0.0, *, out, lse_out):
    _paged_attention_impl(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left,
                          logits_soft_cap, out, lse_out)


torch.library.impl("ragattn::paged_attention", ("CPU", "CUDA"), _paged_attention_impl)
torch.library.impl("ragattn::paged_attention.out", ("CPU", "CUDA"), _paged_attention_out_impl)


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


@torch.library.register_fake("ragattn::_paged_attention_cpu")
def _paged_attention_cpu_fake(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left,
                              logits_soft_cap, *, out, lse_out):
    return None
