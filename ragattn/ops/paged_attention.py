"""``ragattn.paged_attention``: Q-indexed sparse prefill and decode over a paged KV cache.

The one-call op: its wrapper, impls and fakes; its checks are ``ragattn.ops.paged_checks``, its
backends ``ragattn.ops.paged_kernels`` (chosen by ``ragattn.ops.backend``). The plan/run pair
over a ``PageTable`` is ``ragattn.ops.paged_attention_run``.

    out, lse = paged_attention(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens,
                               scale=None, window_left=-1, logits_soft_cap=0.0, out=None, lse_out=None)
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from ragattn.ops import backend
from ragattn.ops._direct_call import plain_cpu_call
from ragattn.ops._validate import check_soft_cap
from ragattn.ops.paged_checks import check_values, validate
from ragattn.ops.paged_kernels import call_out, cpu_kernel, triton_one_call
from ragattn.reference.paged_attention import paged_attention as _reference

_OP = "paged_attention"


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
    kernel under the interpreter with ``RAGATTN_CPU_BACKEND=triton`` (:func:`ragattn.ops.backend.choose`). On
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




def _paged_attention_impl(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale=None, window_left=-1,
                          logits_soft_cap=0.0, out=None, lse_out=None):
    """``torch.ops.ragattn.paged_attention`` (and ``.out``) on CPU and CUDA: every check, then the
    backend :func:`ragattn.ops.backend.choose` gives."""
    args = (q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left)
    validate(*args, out, lse_out, read_values=False, logits_soft_cap=logits_soft_cap)
    chosen = backend.choose("paged_attention", q.device.type)
    if chosen == backend.CPP:   # (the C++ kernel reads and checks the index values in one pass)
        return cpu_kernel(*args, logits_soft_cap, out, lse_out)
    if q.device.type == "cpu" or os.environ.get("RAGATTN_DEBUG", "0") == "1":   # (a GPU precondition)
        check_values(q_pos, cu_seqlens_q, block_table, kv_lens, None, k_cache.shape[1], k_cache.shape[0])
    if chosen == backend.TRITON:
        return triton_one_call(*args, out, lse_out, logits_soft_cap)
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
    validate(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left, read_values=False,
              logits_soft_cap=logits_soft_cap)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)  # contiguous, like the kernels


@torch.library.register_fake("ragattn::paged_attention.out")
def _paged_attention_out_fake(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale=None,
                              window_left=-1, logits_soft_cap=0.0, *, out, lse_out):
    validate(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left, out, lse_out,
              read_values=False, logits_soft_cap=logits_soft_cap)


@torch.library.register_fake("ragattn::_paged_attention_cpu")
def _paged_attention_cpu_fake(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left,
                              logits_soft_cap, *, out, lse_out):
    return None
