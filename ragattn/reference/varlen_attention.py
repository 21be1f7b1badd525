"""Reference of ``ragattn.varlen_attention``: dense per-sequence attention with the position/block mask.

Plain torch, float64-capable, differentiable (its autograd is the CPU backward of the op).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


def _default_pos(cu: torch.Tensor, total: int) -> torch.Tensor:
    """``arange`` per sequence: token ``t`` of a sequence starting at ``cu[b]`` gets ``t - cu[b]``."""
    idx = torch.arange(total, device=cu.device, dtype=torch.int64)
    seq = torch.searchsorted(cu[1:].long(), idx, right=True)
    return (idx - cu.long()[seq]).to(torch.int32)


def visible_mask(
    q_pos: torch.Tensor, kv_pos: torch.Tensor, q_block: torch.Tensor, kv_block: torch.Tensor, causal: bool,
    window_left: int = -1,
) -> torch.Tensor:
    """bool ``[len_q, len_k]``: query ``i`` sees key ``j`` (design.md op 1) for one sequence's int vectors."""
    qb, kb = q_block.long()[:, None], kv_block.long()[None, :]
    mask = (qb == kb) | (qb == -1) | (kb == -1)
    qp, kp = q_pos.long()[:, None], kv_pos.long()[None, :]  # int64: no wrap at 2^31 - 1
    if causal:
        mask = mask & (kp <= qp)
    if window_left >= 0:
        mask = mask & (kp >= qp - window_left)
    return mask


def _masked(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, x, torch.zeros_like(x))


def _visible_scores(qq: torch.Tensor, kk: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``qq @ kk^T`` ``[H, Lq, Lk]`` (values at masked pairs unspecified, the caller fills them)
    whose backward never multiplies a masked pair's zero gradient by a non-finite operand.

    Non-finite elements are zeroed for the matmul; the (rare) query and key rows holding one are
    recomputed from operands selected by the mask, so a visible non-finite value still propagates.
    """
    q_ok, k_ok = torch.isfinite(qq), torch.isfinite(kk)
    if bool(q_ok.all()) and bool(k_ok.all()):
        return qq @ kk.transpose(1, 2)
    s = _masked(qq, q_ok) @ _masked(kk, k_ok).transpose(1, 2)
    for h, j in (~k_ok.all(-1)).nonzero().tolist():  # key rows with a non-finite element
        keep = mask[:, j, None]  # [Lq, 1]
        s[h, :, j] = (_masked(qq[h], keep) * _masked(kk[h, j].expand_as(qq[h]), keep)).sum(-1)
    for h, i in (~q_ok.all(-1)).nonzero().tolist():  # query rows with a non-finite element
        keep = mask[i, :, None]  # [Lk, 1]
        s[h, i, :] = (_masked(qq[h, i].expand_as(kk[h]), keep) * _masked(kk[h], keep)).sum(-1)
    return s


def _visible_weighted_sum(p: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``p @ v`` ``[H, Lq, D]`` that reads each query's visible keys only (``mask`` ``[Lq, Lk]``).

    ``p`` is 0 at masked pairs, but ``0 * NaN`` and ``0 * inf`` are NaN: a plain matmul would leak a
    non-finite V of a key into queries that cannot see it. Non-finite V elements are zeroed for the
    matmul, and the (rare) columns holding one are recomputed exactly over the visible pairs only,
    so a visible non-finite value still propagates as IEEE arithmetic says.
    """
    finite = torch.isfinite(v)
    if bool(finite.all()):
        return p @ v
    out = p @ _masked(v, finite)
    cols = (~finite).any(dim=1)  # [H, D]: columns with a non-finite element
    for h, d in cols.nonzero().tolist():
        vd = _masked(v[h, :, d][None, :].expand_as(p[h]), mask)  # [Lq, Lk]
        out[h, :, d] = (p[h] * vd).sum(-1)
    return out


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
    upcast: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dense reference: ``out`` like ``q`` ``[total_q, H, D]``, ``lse`` float32 ``[total_q, H]``.

    q ``[total_q, H, D]``, k/v ``[total_k, H_kv, D]`` (GQA: head h reads kv head h // (H // H_kv)),
    cu_seqlens_* int32/int64 ``[B + 1]``, positions/blocks int32/int64 ``[total_q]`` / ``[total_k]``,
    ``window_left`` and ``logits_soft_cap`` as in ``ragattn.varlen_attention`` (-1 / 0: off).
    ``upcast=True`` computes in float32 (float64 for float64 inputs); ``upcast=False`` mimics a
    kernel in the input dtype (scores and P@V in the input dtype, softmax in float32): that is the
    "same computation in the input dtype" of the tests' precision rule.
    """
    total_q, num_heads, head_dim = q.shape
    total_k, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    q_pos = _default_pos(cu_seqlens_q, total_q) if q_pos is None else q_pos
    kv_pos = _default_pos(cu_seqlens_k, total_k) if kv_pos is None else kv_pos
    q_block = torch.full((total_q,), -1, dtype=torch.int32, device=q.device) if q_block is None else q_block
    kv_block = torch.full((total_k,), -1, dtype=torch.int32, device=q.device) if kv_block is None else kv_block

    if q.dtype == torch.float64:
        cdt = torch.float64
    elif upcast:
        cdt = torch.float32
    else:
        cdt = q.dtype
    sdt = torch.float64 if q.dtype == torch.float64 else torch.float32  # softmax dtype

    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if qe == qs:
            continue
        qq = q[qs:qe].to(cdt).transpose(0, 1)  # [H, Lq, D]
        kk = k[ks:ke].to(cdt).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, Lk, D]
        vv = v[ks:ke].to(cdt).repeat_interleave(group, dim=1).transpose(0, 1)
        mask = visible_mask(q_pos[qs:qe], kv_pos[ks:ke], q_block[qs:qe], kv_block[ks:ke], causal, window_left)
        scores = _visible_scores(qq, kk, mask).to(sdt) * scale  # [H, Lq, Lk]
        if logits_soft_cap > 0:  # Gemma 2's attn_logit_softcapping, before the mask
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        scores = scores.masked_fill(~mask, float("-inf"))
        # Rows with no visible key: out 0, lse -inf, and no NaN in the forward or backward.
        m = scores.amax(dim=-1, keepdim=True).detach() if scores.shape[-1] else scores.new_full(scores.shape[:-1] + (1,), float("-inf"))
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        e = torch.exp(scores - m)
        s = e.sum(dim=-1, keepdim=True)
        empty = s == 0
        s_safe = torch.where(empty, torch.ones_like(s), s)
        p = _masked(e / s_safe, mask)  # exact zeros at masked pairs, even in a NaN row
        out = _visible_weighted_sum(p.to(cdt), vv, mask).transpose(0, 1)  # [Lq, H, D]
        lse = torch.where(empty, torch.full_like(s, float("-inf")), torch.log(s_safe) + m).squeeze(-1).transpose(0, 1)
        outs.append(out.to(q.dtype))
        lses.append(lse.float())
    if not outs:
        return q * 0, torch.full((total_q, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    out = torch.cat(outs, dim=0)
    lse = torch.cat(lses, dim=0)
    if out.shape[0] != total_q:  # cu_seqlens_q does not cover every row (cannot happen after validation)
        raise ValueError("ragattn.reference.varlen_attention: cu_seqlens_q must end at total_q")
    return out, lse
