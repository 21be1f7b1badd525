"""``ragattn.key_attention_scores``: FusionRAG's query-guided key importance (design.md op 6).

Registers the CPU impl (the reference's arithmetic with GQA folded into the rows, the reference
itself with ``RAGATTN_CPU_BACKEND=reference``, or the Triton kernel in the interpreter when
``RAGATTN_CPU_BACKEND=triton``), the CUDA impl (Triton) and the fake impl against the schema
declared in csrc/torch_bindings.cpp.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ragattn.ops import backend
from ragattn.ops._direct_call import plain_cpu_call
from ragattn.ops._validate import (
    FLOAT_DTYPES, INDEX_DTYPES, check_cu_seqlens, check_same_device, check_tensor, cpu_qk_well_formed, device_guard,
)
from ragattn.reference import key_attention_scores as _reference

_OP = "key_attention_scores"


def _validate(q, k, cu_seqlens_q, cu_seqlens_k, scale, *, check_values: bool) -> None:
    """Shape/dtype/device checks; ``check_values`` also reads the (CPU) offsets' values."""
    if _well_formed(q, k, cu_seqlens_q, cu_seqlens_k, scale):
        if not check_values or (_offsets_ok(cu_seqlens_q, q.shape[0]) and _offsets_ok(cu_seqlens_k, k.shape[0])):
            return
    check_tensor(_OP, "q", q, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor(_OP, "k", k, dtypes=FLOAT_DTYPES, ndim=3)
    dev = check_same_device(_OP, q=q, k=k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if k.dtype != q.dtype:
        raise TypeError(f"ragattn.{_OP}: k must have q's dtype {q.dtype}, got {k.dtype}")
    total_q, num_heads, head_dim = q.shape
    total_k, num_kv_heads, k_dim = k.shape
    if k_dim != head_dim:
        raise ValueError(f"ragattn.{_OP}: k must have head_dim {head_dim} (q's), got shape {tuple(k.shape)}")
    if head_dim == 0:
        raise ValueError(f"ragattn.{_OP}: q must have head_dim > 0, got shape {tuple(q.shape)}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"ragattn.{_OP}: k's num_kv_heads must divide q's num_heads {num_heads}, got {num_kv_heads}"
        )
    kw = dict(dtypes=INDEX_DTYPES, read_values=check_values)
    bq = check_cu_seqlens(_OP, "cu_seqlens_q", cu_seqlens_q, total_q, dev, **kw)
    bk = check_cu_seqlens(_OP, "cu_seqlens_k", cu_seqlens_k, total_k, dev, **kw)
    if bq != bk:
        raise ValueError(
            f"ragattn.{_OP}: cu_seqlens_q and cu_seqlens_k must describe the same batch, got "
            f"{bq + 1} and {bk + 1} entries"
        )
    if scale is not None and not (scale == scale and abs(scale) != float("inf")):
        raise ValueError(f"ragattn.{_OP}: scale must be finite, got {scale}")


def _well_formed(q, k, cu_seqlens_q, cu_seqlens_k, scale) -> bool:
    """A fast sufficient condition for the metadata checks of ``_validate`` to pass, for CPU
    tensors; False only means "run them" (they raise with the argument's name)."""
    if not cpu_qk_well_formed(q, k, cu_seqlens_q, cu_seqlens_k, FLOAT_DTYPES):
        return False
    return scale is None or math.isfinite(scale)


def _offsets_ok(cu: torch.Tensor, total: int) -> bool:
    """The value checks of ``check_cu_seqlens`` as one predicate (False: run it, it raises)."""
    vals = cu.tolist()
    return vals[0] == 0 and vals[-1] == total and all(a <= b for a, b in zip(vals, vals[1:]))


def _triton_impl(q, k, cu_seqlens_q, cu_seqlens_k, scale):
    from ragattn.triton_kernels.key_attention_scores import key_attention_scores as _kernel

    return _kernel(q, k, cu_seqlens_q, cu_seqlens_k, scale)


def _cpu_impl(q, k, cu_seqlens_q, cu_seqlens_k, scale=None):
    _validate(q, k, cu_seqlens_q, cu_seqlens_k, scale, check_values=True)
    chosen = backend.choose(_OP, "cpu")
    if chosen == backend.TRITON:
        return _triton_impl(q, k, cu_seqlens_q, cu_seqlens_k, scale)
    if chosen == backend.REFERENCE:
        return _reference(q, k, cu_seqlens_q, cu_seqlens_k, scale)
    return _cpu_scores(q, k, cu_seqlens_q, cu_seqlens_k, scale)


torch.library.impl(f"ragattn::{_OP}", "CPU", _cpu_impl)


def _cpu_scores(q, k, cu_seqlens_q, cu_seqlens_k, scale):
    """The default CPU path: the reference's arithmetic (float32 logits, softmax over each
    sequence's keys, summed over rows and heads) with the GQA group folded into the query rows
    (one batched matmul per kv head, K never repeated) and the scale folded into the matmul."""
    total_q, num_heads, head_dim = q.shape
    total_k, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()

    def sequence_scores(q0, q1, k0, k1):
        # rows (i, g) of kv head h: [Hkv, Mq * G, D]
        qb = q[q0:q1].float().reshape(q1 - q0, num_kv_heads, group, head_dim).transpose(0, 1).reshape(
            num_kv_heads, (q1 - q0) * group, head_dim)
        kb = k[k0:k1].float().transpose(0, 1)  # [Hkv, Nk, D], a view
        logits = torch.baddbmm(qb.new_empty(()), qb, kb.transpose(1, 2), beta=0.0, alpha=scale)
        return torch.softmax(logits, dim=-1).sum(dim=(0, 1))

    if len(cq) == 2 and cq[1] > 0 and ck[1] > 0:  # one sequence (the common call): its scores are the output
        return sequence_scores(0, cq[1], 0, ck[1])
    scores = torch.zeros(total_k, dtype=torch.float32)
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0 or k1 == k0:
            continue  # no query: every key receives 0; no key: nothing to write
        scores[k0:k1] = sequence_scores(q0, q1, k0, k1)
    return scores


@torch.library.impl(f"ragattn::{_OP}", "CUDA")
def _cuda_impl(q, k, cu_seqlens_q, cu_seqlens_k, scale=None):
    _validate(q, k, cu_seqlens_q, cu_seqlens_k, scale, check_values=True)
    with device_guard(q):
        return _triton_impl(q, k, cu_seqlens_q, cu_seqlens_k, scale)


@torch.library.register_fake(f"ragattn::{_OP}")
def _fake_impl(q, k, cu_seqlens_q, cu_seqlens_k, scale=None):
    _validate(q, k, cu_seqlens_q, cu_seqlens_k, scale, check_values=False)
    return q.new_empty((k.shape[0],), dtype=torch.float32)


def key_attention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Attention probability mass each key row receives from its sequence's queries, over all heads.

    FusionRAG's query-guided selection (paper §3.2): the final layer's question queries attend to
    the retrieved chunks' cached keys; each key's column sum of the attention matrix is its
    critical score, and the top-k keys by score (globally or per chunk) are the tokens whose KV is
    recomputed. This op returns the scores; the caller runs ``torch.topk`` on them.

    Args:
        q: ``[total_q, num_heads, head_dim]`` fp16/bf16/fp32, packed query rows (the question).
        k: ``[total_k, num_kv_heads, head_dim]``, q's dtype, packed key rows (the chunks' keys);
            ``num_heads % num_kv_heads == 0``, query head ``h`` reads kv head
            ``h // (num_heads // num_kv_heads)`` (no repeated K is materialised).
        cu_seqlens_q: int32 or int64 ``[batch + 1]``, offsets of each sequence's query rows (from 0).
        cu_seqlens_k: int32 or int64 ``[batch + 1]``, offsets of each sequence's key rows (from 0).
        scale: logit scale, default ``1 / sqrt(head_dim)``.

    Returns:
        scores: float32 ``[total_k]``. For key ``j`` of sequence ``b``::

            scores[j] = sum_{h < num_heads} sum_{i in queries of b} softmax_j'(scale * q[i,h] . k[j',h//G])[j]

        with the softmax over ALL keys of sequence ``b`` (non-causal, one normalisation per query
        row and head), computed in float32. So the scores of a sequence sum to
        ``num_q_rows * num_heads``; a sequence without query rows gets 0 for each of its keys.

    Non-finite inputs (one rule on every backend, that of the float64 reference): every key of a
    sequence takes part in every one of its query rows' softmax, so a logit that leaves a row's
    softmax undefined (NaN, or ``+inf``: a NaN or inf in any of the sequence's q or k rows,
    unless the product is exactly ``-inf``) makes **every** score of that sequence NaN, not only
    the key's own. A ``-inf`` logit is a key of probability 0. Other sequences are unaffected.

    Differences from the FusionRAG code: its repository softmaxes each chunk separately (in
    fp16), giving every chunk the same total mass. Here one sequence is normalised as a whole;
    to reproduce per-chunk normalisation, pass each chunk as its own sequence with the question
    rows repeated in ``q``. Scores are summed (not averaged) over query rows and heads, as in the
    paper. Under tensor parallelism, all-reduce the scores across ranks before the top-k.

    On CUDA with batch > 1 the offsets are read back once (one host sync) to size the launch
    grids; a single sequence needs no sync.
    """
    if (scale is None or type(scale) is float) and plain_cpu_call(q, k, cu_seqlens_q, cu_seqlens_k):
        return _cpu_impl(q, k, cu_seqlens_q, cu_seqlens_k, scale)  # what torch.ops would run, without its dispatch
    return torch.ops.ragattn.key_attention_scores(q, k, cu_seqlens_q, cu_seqlens_k, scale)
