"""``ragattn.varlen_attention``: packed prefill with position/block masks, never materialised.

Dispatch: CUDA tensors run the Triton kernels (triton_kernels/varlen_attention.py); CPU tensors
run the C++ forward and backward (``ragattn::_varlen_attention_cpu`` and
``_varlen_attention_backward_cpu``, csrc/attention/varlen_attention_cpu.cpp; dense float32 calls,
where torch's fused CPU flash attention is faster, take that: ``_varlen_sdpa_cpu``, with the
reference where a fused result is non-finite), the plain-torch reference with ``RAGATTN_CPU_BACKEND=reference``,
or the Triton kernels in the interpreter with ``RAGATTN_CPU_BACKEND=triton``. Any head_dim up to 256 runs in Triton (padded to the next power of
two with a mask: 80, 96, 112 included); larger head dims and float64 inputs always take the
reference (on any device, O(L^2) memory). The backward is ``ragattn::varlen_attention_backward`` (Triton where the
forward is Triton, the CPU paths above by default on CPU, the reference's autograd otherwise), wired with
``torch.library.register_autograd``.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ragattn.ops import backend
from ragattn.ops._validate import (
    check_soft_cap,
    FLOAT_DTYPES, INDEX_DTYPES, check_cu_seqlens, check_no_overlap, check_same_device, check_tensor,
    cpu_qk_well_formed, device_guard,
)
from ragattn.ops import _varlen_sdpa_cpu as _sdpa_cpu
from ragattn.ops._direct_call import plain_cpu_call
from ragattn.reference import varlen_attention as _ref

OP = "varlen_attention"

__all__ = ["varlen_attention"]


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    q_pos: Optional[torch.Tensor] = None,
    kv_pos: Optional[torch.Tensor] = None,
    q_block: Optional[torch.Tensor] = None,
    kv_block: Optional[torch.Tensor] = None,
    causal: bool = True,
    scale: Optional[float] = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    *,
    out: Optional[torch.Tensor] = None,
    lse_out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences with a structured (position, block) mask.

    Args:
        q: ``[total_q, H, D]`` fp16 / bf16 / fp32 (fp64 runs the reference), packed query rows.
        k, v: ``[total_k, H_kv, D]``, same dtype as ``q``; ``H % H_kv == 0`` and query head ``h``
            reads kv head ``h // (H // H_kv)`` (GQA by index, K/V are never repeated).
        cu_seqlens_q: int32 or int64 ``[B + 1]``, sequence ``b`` owns query rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
        cu_seqlens_k: int32 or int64 ``[B + 1]``, likewise for key rows. Lengths may differ from the
            queries' and may be 0.
        q_pos: int32 or int64 ``[total_q]`` absolute positions (values within int32); default
            ``arange(len_q)`` per sequence.
        kv_pos: int32 or int64 ``[total_k]``; default ``arange(len_k)`` per sequence. With different q/k
            lengths the defaults are aligned at the top-left (both start at 0): pass ``q_pos``
            explicitly (e.g. ``len_k - len_q + arange(len_q)``) for a bottom-right aligned mask.
        q_block: int32 or int64 ``[total_q]`` block ids, ``-1`` = global; default all ``-1``.
        kv_block: int32 or int64 ``[total_k]`` block ids, ``-1`` = global; default all ``-1``.
        causal: apply ``kv_pos <= q_pos``.
        scale: softmax scale; default ``1 / sqrt(D)``.
        window_left: sliding window, FlashAttention's ``window_size=(window_left, -1)`` and
            FlashInfer's ``window_left``: a key is visible only if ``kv_pos >= q_pos - window_left``,
            so a causal query sees itself and the ``window_left`` positions before it
            (``window_left + 1`` keys). ``-1`` (default): no window. Applies to global (block -1)
            tokens too. transformers' ``config.sliding_window`` (Mistral, Qwen2, Gemma local
            layers: ``sliding_window_overlay`` keeps ``kv_idx > q_idx - sliding_window``) maps to
            ``window_left = sliding_window - 1``.
        logits_soft_cap: FlashInfer's name; ``> 0``: each score, after ``scale`` and before the
            mask, becomes ``cap * tanh(score / cap)`` (Gemma 2's ``attn_logit_softcapping``; the
            backward multiplies by ``1 - tanh^2``); 0 (default): off. Finite and ``>= 0``.
        out, lse_out: optional preallocated outputs (engines' ``out=``): ``out`` contiguous like
            ``q``, ``lse_out`` float32 ``[total_q, H]`` of any strides (e.g. the ``.t()`` of an
            engine's ``[H, total_q]`` buffer), on ``q``'s device, sharing no
            memory with any input; written in place and returned (one given, the other is
            allocated). Runs ``torch.ops.ragattn.varlen_attention.out``; not differentiable.

    Returns:
        ``out`` ``[total_q, H, D]`` in ``q``'s dtype and ``lse`` float32 ``[total_q, H]`` (natural
        log of the softmax denominator, scaled scores). A row that sees no key gets ``out = 0`` and
        ``lse = -inf`` (never NaN). ``lse`` is not differentiable (its gradient is ignored).

    Query ``i`` sees key ``j`` of the same sequence iff::

        (not causal or kv_pos[j] <= q_pos[i]) and
        (q_block[i] == kv_block[j] or q_block[i] == -1 or kv_block[j] == -1) and
        (window_left < 0 or kv_pos[j] >= q_pos[i] - window_left)

    Sliding window, ``causal=True, window_left=2`` (each query sees itself and 2 keys back)::

               keys: 0 1 2 3 4 5
        query 0      #
        query 1      # #
        query 2      # # #
        query 3        # # #
        query 4          # # #
        query 5            # # #

    Masked keys are never read: a NaN or inf in the K or V of a key that query ``i`` cannot see
    never reaches ``out[i]``, ``lse[i]`` or any gradient of query ``i``. Non-finite values in a
    *visible* key follow IEEE arithmetic over the visible keys only: wherever the float64
    reference restricted to the visible keys is non-finite, the op's output is non-finite too
    (NaN, or the reference's ``+-inf``; which of the two is not specified), and where it is finite
    the op matches it. Gradients are specified for finite visible inputs only.

    Block-Attention / TurboRAG prefill (causal, chunks independent, final block global; a shared
    system prompt is block -1 and seen by every chunk)::

                         keys:  sys  | chunk 0 | chunk 1 | question (tail)
                        block:  -1   |    0    |    1    |   -1
        queries  sys    (-1)    \\    |         |         |
                 chunk 0 (0)    ###  |  \\      |         |
                 chunk 1 (1)    ###  |         |  \\      |
                 question (-1)  ###  |  #####  |  #####  |  \\
        (``\\`` = causal triangle, ``#`` = fully visible, blank = skipped tiles, never computed)

    REFRAG's chunk encoder (``causal=False``, one block per chunk, no global)::

                  chunk 0 | chunk 1 | chunk 2
        chunk 0    #####  |         |
        chunk 1           |  #####  |
        chunk 2           |         |  #####
    """
    if type(logits_soft_cap) is not float:   # (the schema would coerce or reject it unnamed)
        check_soft_cap(OP, logits_soft_cap)
        logits_soft_cap = float(logits_soft_cap)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, causal, scale, window_left,
            logits_soft_cap)
    if out is None and lse_out is None:
        if (type(causal) is bool and (scale is None or type(scale) is float) and type(window_left) is int
                and type(logits_soft_cap) is float and plain_cpu_call(*args[:9])):
            return _varlen_attention_impl(*args)  # what torch.ops would run, without its dispatch
        return torch.ops.ragattn.varlen_attention(*args)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
        raise RuntimeError(f"ragattn.{OP}: out= / lse_out= do not support automatic differentiation (as in ATen)")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if lse_out is None:
        lse_out = q.new_empty(q.shape[:2], dtype=torch.float32)
    torch.ops.ragattn.varlen_attention.out(*args, out=out, lse_out=lse_out)
    return out, lse_out


def _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, scale, window_left, *,
              check_values: bool = True, logits_soft_cap=0.0):
    """Every check of the op; the fake impl runs it too (``check_values=False``: no data to read).
    ``check_values`` runs ``_check_index_values`` last (the default CPU path runs it once per
    cached plan instead: those checks read only the index tensors)."""
    if not _well_formed(q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, scale, window_left):
        _check_metadata(q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, scale, window_left)
    if logits_soft_cap != 0.0 or type(logits_soft_cap) is not float:
        check_soft_cap(OP, logits_soft_cap)
    if check_values:
        _check_index_values(cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, q.shape[0], k.shape[0])


_Q_DTYPES = FLOAT_DTYPES + (torch.float64,)


def _well_formed(q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, scale, window_left) -> bool:
    """A fast sufficient condition for ``_check_metadata`` to pass, for the common case (every
    tensor on the CPU): ~1/4 of its cost. False only means "run the full checks" (they raise)."""
    if not (cpu_qk_well_formed(q, k, cu_seqlens_q, cu_seqlens_k, _Q_DTYPES) and isinstance(v, torch.Tensor)
            and v.dtype == q.dtype and v.shape == k.shape and v.is_cpu):
        return False
    total_q, total_k, T = q.shape[0], k.shape[0], torch.Tensor
    for t, n in ((q_pos, total_q), (kv_pos, total_k), (q_block, total_q), (kv_block, total_k)):
        if t is not None and not (isinstance(t, T) and t.is_cpu and t.dtype in INDEX_DTYPES and t.dim() == 1
                                  and t.shape[0] == n):
            return False
    if scale is not None and not math.isfinite(scale):
        return False
    return -1 <= window_left <= 2**31 - 1


def _check_metadata(q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, scale, window_left):
    """The checks that read no tensor data, each with its named error."""
    dtypes = _Q_DTYPES
    check_tensor(OP, "q", q, dtypes=dtypes, ndim=3)
    dev = check_same_device(
        OP, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        q_pos=q_pos, kv_pos=kv_pos, q_block=q_block, kv_block=kv_block,
    )
    total_q, num_heads, head_dim = q.shape
    if head_dim == 0:
        raise ValueError(f"ragattn.{OP}: q must have head_dim > 0, got shape {tuple(q.shape)}")
    check_tensor(OP, "k", k, dtypes=(q.dtype,), ndim=3)
    total_k, num_kv_heads = k.shape[0], k.shape[1]
    check_tensor(OP, "k", k, shape=(None, None, head_dim))
    check_tensor(OP, "v", v, dtypes=(q.dtype,), shape=tuple(k.shape))
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"ragattn.{OP}: q's head count must be a multiple of k's (GQA), got {num_heads} and {num_kv_heads}"
        )
    kw = dict(dtypes=INDEX_DTYPES, read_values=False)
    b_q = check_cu_seqlens(OP, "cu_seqlens_q", cu_seqlens_q, total_q, dev, **kw)
    b_k = check_cu_seqlens(OP, "cu_seqlens_k", cu_seqlens_k, total_k, dev, **kw)
    if b_q != b_k:
        raise ValueError(
            f"ragattn.{OP}: cu_seqlens_q and cu_seqlens_k must describe the same batch, got {b_q + 1} and {b_k + 1} entries"
        )
    for name, t, n in (("q_pos", q_pos, total_q), ("kv_pos", kv_pos, total_k), ("q_block", q_block, total_q), ("kv_block", kv_block, total_k)):
        if t is not None:
            check_tensor(OP, name, t, dtypes=INDEX_DTYPES, shape=(n,))
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"ragattn.{OP}: scale must be finite, got {scale}")
    if window_left < -1 or window_left > 2**31 - 1:
        raise ValueError(f"ragattn.{OP}: window_left must be -1 (no window) or in [0, 2^31 - 1], got {window_left}")


def _check_index_values(cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, total_q, total_k):
    """The checks that read the (CPU) index tensors' values: offsets from 0 to the packed length,
    non-decreasing; int64 positions and block ids within int32 (the kernels')."""
    dev = cu_seqlens_q.device
    check_cu_seqlens(OP, "cu_seqlens_q", cu_seqlens_q, total_q, dev, dtypes=INDEX_DTYPES)
    check_cu_seqlens(OP, "cu_seqlens_k", cu_seqlens_k, total_k, dev, dtypes=INDEX_DTYPES)
    for name, t in (("q_pos", q_pos), ("kv_pos", kv_pos), ("q_block", q_block), ("kv_block", kv_block)):
        if t is not None and t.dtype == torch.int64 and t.device.type == "cpu" and t.numel():
            lo, hi = t.aminmax()
            lo, hi = int(lo), int(hi)
            if lo < -(2**31) or hi > 2**31 - 1:
                raise ValueError(f"ragattn.{OP}: {name} values must fit in int32, got {lo} .. {hi}")


def _validate_out(q, out, lse_out, inputs):
    """Preallocated outputs: exact shape and dtype, q's device, out contiguous (lse_out any strides,
    e.g. a transposed [H, total_q] buffer's .t(), as paged_attention's), no memory shared with an
    input or with each other (the kernel would read what it already wrote)."""
    check_tensor(OP, "out", out, dtypes=(q.dtype,), shape=tuple(q.shape), device=q.device, contiguous=True)
    check_tensor(OP, "lse_out", lse_out, dtypes=(torch.float32,), shape=tuple(q.shape[:2]), device=q.device)
    check_no_overlap(OP, {"out": out, "lse_out": lse_out}, inputs)


def _use_triton(q: torch.Tensor) -> bool:
    return backend.choose(OP, q.device.type, q.dtype, q.shape[-1]) == backend.TRITON


def _use_sdpa_cpu(q: torch.Tensor) -> bool:
    """The default CPU paths (the C++ forward and backward; ``_varlen_sdpa_cpu`` for dense float32
    calls) for fp16/bf16/fp32 CPU inputs; the caller reruns the reference where the fused path
    returns a non-finite value (it may come from a masked key)."""
    return backend.choose(OP, q.device.type, q.dtype, q.shape[-1]) == backend.CPP


def _cpu_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, causal, scale, window_left,
                 logits_soft_cap=0.0):
    """The default CPU forward: ``ragattn::_varlen_attention_cpu`` (csrc/attention/varlen_attention_cpu.cpp,
    after ``_validate``'s metadata checks; it runs the index-value checks itself). It reads only
    each row's visible keys: masked non-finite K/V never reach a result, no reference rerun."""
    return torch.ops.ragattn._varlen_attention_cpu.default(q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block,
                                                           kv_block, causal, scale, window_left,
                                                           float(logits_soft_cap))


# Dense calls (non-causal, no window, no blocks: every key of a sequence visible to each of its
# rows, e.g. REFRAG's chunk encoder) of float32 rows run faster in torch's fused CPU attention,
# unmasked at GEMM speed, than in the C++ kernel from about this many (row, key) pairs on. Fused /
# C++ time, one thread, h9 kv3 d64, interleaved: 16 sequences x 16 tokens 1.27, 16 x 32 0.94,
# 16 x 64 0.88, 1 x 512 0.72; bf16 8 x 100 1.04. Masked calls do fewer pairs in C++ and stay there.
_SDPA_DENSE_MIN_PAIRS, _SDPA_DENSE_MIN_SEQ_PAIRS = 8192, 512


def _dense_sdpa_wins(q, k, cu_seqlens_q, cu_seqlens_k, q_block, kv_block, causal, window_left, softcap=0.0) -> bool:
    if softcap or causal or window_left >= 0 or q_block is not None or kv_block is not None or q.dtype != torch.float32:
        return False
    if q.shape[0] * k.shape[0] < _SDPA_DENSE_MIN_PAIRS:
        return False
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    lens = [(cq[i + 1] - cq[i]) * (ck[i + 1] - ck[i]) for i in range(len(cq) - 1)]
    pairs = sum(lens)
    return pairs >= _SDPA_DENSE_MIN_PAIRS and pairs >= _SDPA_DENSE_MIN_SEQ_PAIRS * sum(1 for n in lens if n)


def _contig(*ts):
    return [None if t is None else t.contiguous() for t in ts]


def _varlen_attention_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos=None, kv_pos=None, q_block=None, kv_block=None, causal=True, scale=None, window_left=-1,
                           logits_soft_cap=0.0):
    index = (cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block)
    _validate(q, k, v, *index, scale, window_left, check_values=False, logits_soft_cap=logits_soft_cap)
    if _use_sdpa_cpu(q):
        if not _dense_sdpa_wins(q, k, cu_seqlens_q, cu_seqlens_k, q_block, kv_block, causal, window_left, logits_soft_cap):
            return _cpu_forward(q, k, v, *index, causal, scale, window_left, logits_soft_cap)
        out, lse = _sdpa_cpu.run_forward(q, k, v, *index, causal, scale, window_left,
                                         check=lambda: _check_index_values(*index, q.shape[0], k.shape[0]))
        if not _sdpa_cpu.has_nonfinite(out):
            return out, lse
    else:
        _check_index_values(*index, q.shape[0], k.shape[0])
    if _use_triton(q):
        from ragattn.triton_kernels.varlen_attention import varlen_attention_fwd

        with device_guard(q):
            return varlen_attention_fwd(*_contig(q, k, v, *index), causal, scale, window_left,
                                        logits_soft_cap=logits_soft_cap)
    with torch.no_grad():
        out, lse = _ref(q, k, v, *index, causal, scale, window_left, logits_soft_cap)
    return out.contiguous(), lse.contiguous()


torch.library.impl("ragattn::varlen_attention", ("CPU", "CUDA"), _varlen_attention_impl)


@torch.library.register_fake("ragattn::varlen_attention")
def _varlen_attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos=None, kv_pos=None, q_block=None, kv_block=None, causal=True, scale=None, window_left=-1,
                           logits_soft_cap=0.0):
    _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, scale, window_left, check_values=False,
              logits_soft_cap=logits_soft_cap)
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.register_fake("ragattn::_varlen_attention_cpu")
def _varlen_attention_cpu_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, causal, scale, window_left,
                               logits_soft_cap=0.0):
    return _varlen_attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, causal, scale,
                                  window_left, logits_soft_cap)


@torch.library.impl("ragattn::varlen_attention.out", ("CPU", "CUDA"))
def _varlen_attention_out_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos=None, kv_pos=None, q_block=None, kv_block=None,
                               causal=True, scale=None, window_left=-1, logits_soft_cap=0.0, *, out, lse_out):
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block)
    _validate(*args, scale, window_left, logits_soft_cap=logits_soft_cap)
    _validate_out(q, out, lse_out, dict(zip(_ARG_NAMES, args)))
    if _use_triton(q):
        from ragattn.triton_kernels.varlen_attention import varlen_attention_fwd

        lse_k = lse_out if lse_out.is_contiguous() else None  # the kernel stores contiguous rows
        with device_guard(q):
            _, l = varlen_attention_fwd(*_contig(*args), causal, scale, window_left, out=out, lse=lse_k,
                                        logits_soft_cap=logits_soft_cap)
        if lse_k is None:
            lse_out.copy_(l)
        return
    o = None
    if _use_sdpa_cpu(q):
        if not _dense_sdpa_wins(q, k, cu_seqlens_q, cu_seqlens_k, q_block, kv_block, causal, window_left, logits_soft_cap):
            o, l = _cpu_forward(*args, causal, scale, window_left, logits_soft_cap)
        else:
            o, l = _sdpa_cpu.run_forward(*args, causal, scale, window_left)
            o = None if _sdpa_cpu.has_nonfinite(o) else o
    if o is None:
        with torch.no_grad():
            o, l = _ref(*args, causal, scale, window_left, logits_soft_cap)
    out.copy_(o)
    lse_out.copy_(l)


@torch.library.register_fake("ragattn::varlen_attention.out")
def _varlen_attention_out_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos=None, kv_pos=None, q_block=None, kv_block=None,
                               causal=True, scale=None, window_left=-1, logits_soft_cap=0.0, *, out, lse_out):
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block)
    _validate(*args, scale, window_left, check_values=False, logits_soft_cap=logits_soft_cap)
    _validate_out(q, out, lse_out, dict(zip(_ARG_NAMES, args)))


_ARG_NAMES = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "q_pos", "kv_pos", "q_block", "kv_block")


def _varlen_attention_backward_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, causal, scale, window_left=-1,
                                    logits_soft_cap=0.0):
    index = (cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block)
    _validate(q, k, v, *index, scale, window_left, check_values=False, logits_soft_cap=logits_soft_cap)
    if _use_sdpa_cpu(q) and not _dense_sdpa_wins(q, k, cu_seqlens_q, cu_seqlens_k, q_block, kv_block, causal,
                                                   window_left, logits_soft_cap):
        # the C++ backward (csrc/attention/varlen_attention_cpu.cpp): only visible pairs, masked
        # keys never read into a sum; it runs the index-value checks itself
        return torch.ops.ragattn._varlen_attention_backward_cpu.default(dout, q, k, v, out, lse, *index, causal, scale,
                                                                        window_left, float(logits_soft_cap))
    if _use_sdpa_cpu(q):
        grads = _sdpa_cpu.run_backward(dout, q, k, v, out, lse, *index, causal, scale, window_left,
                                       check=lambda: _check_index_values(*index, q.shape[0], k.shape[0]))
        if not _sdpa_cpu.has_nonfinite(*grads):
            return grads
    else:
        _check_index_values(*index, q.shape[0], k.shape[0])
    if _use_triton(q):
        from ragattn.triton_kernels.varlen_attention import varlen_attention_bwd

        with device_guard(q):
            return varlen_attention_bwd(*_contig(dout, q, k, v, out, lse, *index), causal, scale, window_left,
                                        logits_soft_cap=logits_soft_cap)
    # Reference autograd: recompute the dense forward with grad and pull dout through it.
    with torch.enable_grad():
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        o, _ = _ref(qq, kk, vv, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, causal, scale, window_left,
                    logits_soft_cap)
        grads = torch.autograd.grad(o, (qq, kk, vv), dout, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g.contiguous() for g, t in zip(grads, (q, k, v)))


torch.library.impl("ragattn::varlen_attention_backward", ("CPU", "CUDA"), _varlen_attention_backward_impl)


@torch.library.register_fake("ragattn::varlen_attention_backward")
def _varlen_attention_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, causal, scale, window_left=-1,
                                    logits_soft_cap=0.0):
    _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, scale, window_left, check_values=False,
              logits_soft_cap=logits_soft_cap)
    return (torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


@torch.library.register_fake("ragattn::_varlen_attention_backward_cpu")
def _varlen_attention_backward_cpu_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block,
                                        kv_block, causal, scale, window_left, logits_soft_cap=0.0):
    return _varlen_attention_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block,
                                           kv_block, causal, scale, window_left, logits_soft_cap)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, causal, scale, window_left, logits_soft_cap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, q_pos, kv_pos, q_block, kv_block)
    ctx.causal, ctx.scale, ctx.window_left, ctx.logits_soft_cap = causal, scale, window_left, logits_soft_cap
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, q_pos, kv_pos, q_block, kv_block = ctx.saved_tensors
    dq, dk, dv = torch.ops.ragattn.varlen_attention_backward(
        dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, ctx.causal, ctx.scale,
        ctx.window_left, ctx.logits_soft_cap,
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("ragattn::varlen_attention", _backward, setup_context=_setup_context)
