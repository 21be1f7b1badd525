"""Dense reference of ``key_attention_scores`` (FusionRAG's query-guided key importance).

Plain torch, float64-capable: the tests' ground truth and the CPU fallback.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


def key_attention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: Optional[float] = None,
    *,
    compute_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Attention probability mass each key row receives, summed over its sequence's queries and heads.

    q             [total_q, H, D]   fp16/bf16/fp32/fp64
    k             [total_k, Hkv, D] same dtype, H % Hkv == 0; query head h reads kv head h // (H // Hkv)
    cu_seqlens_q  int32/int64 [B + 1]
    cu_seqlens_k  int32/int64 [B + 1]
    returns       float32 [total_k] (float64 when the inputs are float64)

    For sequence b with queries Q_b and keys K_b:
    ``scores[j] = sum_h sum_i softmax_j(scale * q[i, h] . k[j, h // G])`` over all keys of b
    (non-causal). A NaN or ``+inf`` logit leaves its row's softmax NaN, and so every score of the
    sequence (the documented rule of the op on every backend). ``compute_dtype`` (default: float64 for float64 inputs, else float32) is the
    dtype the logits and softmax are computed in; the tests pass the input dtype to measure the
    error of a low-precision computation.
    """
    total_q, num_heads, head_dim = q.shape
    total_k, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if compute_dtype is None:
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.zeros(total_k, dtype=out_dtype, device=q.device)
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0 or k1 == k0:
            continue  # no query: every key receives 0; no key: nothing to write
        qb = q[q0:q1].to(compute_dtype).transpose(0, 1)  # [H, Mq, D]
        kb = k[k0:k1].to(compute_dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, Nk, D]
        logits = torch.matmul(qb, kb.transpose(1, 2)) * scale  # [H, Mq, Nk]
        probs = torch.softmax(logits, dim=-1)
        scores[k0:k1] = probs.sum(dim=(0, 1)).to(out_dtype)
    return scores
