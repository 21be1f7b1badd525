"""The ragattn ops the methods call, resolved at call time.

Each name resolves to the public op ``ragattn.<name>`` once its branch has landed; until then a
plain-torch implementation of the same design.md contract is used (dense, for development and
tests only; never the fast path). Contracts: see design.md "Op surface v1".
"""
from __future__ import annotations

import math

import torch

import ragattn


def _op(name):
    return getattr(ragattn, name, None)


def _expand_kv(k, hq):
    return k.repeat_interleave(hq // k.shape[1], dim=1)


def _dense(q, k, v, visible, scale):
    """q [Nq,Hq,D], k/v [Nk,Hkv,D], visible bool [Nq,Nk] -> out [Nq,Hq,D], lse fp32 [Nq,Hq]."""
    hq = q.shape[1]
    kf, vf = _expand_kv(k.float(), hq), _expand_kv(v.float(), hq)
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    s = s.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                   # [H, Nq]
    p = torch.exp(s - lse[..., None].clamp_min(-1e30)).nan_to_num(0.0)
    p = torch.where(torch.isfinite(lse)[..., None], p, torch.zeros_like(p))
    out = torch.einsum("hqk,khd->qhd", p, vf)
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos=None, kv_pos=None, q_block=None,
                     kv_block=None, causal=True, scale=None):
    op = _op("varlen_attention")
    if op is not None:
        return op(q, k, v, cu_seqlens_q, cu_seqlens_k, q_pos, kv_pos, q_block, kv_block, causal, scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    nq, nk = q.shape[0], k.shape[0]
    cq, ck = cu_seqlens_q.long(), cu_seqlens_k.long()
    sq = torch.repeat_interleave(torch.arange(len(cq) - 1), cq.diff())
    sk = torch.repeat_interleave(torch.arange(len(ck) - 1), ck.diff())
    if q_pos is None:
        q_pos = torch.arange(nq) - cq[sq]
    if kv_pos is None:
        kv_pos = torch.arange(nk) - ck[sk]
    qb = torch.full((nq,), -1) if q_block is None else q_block.long().cpu()
    kb = torch.full((nk,), -1) if kv_block is None else kv_block.long().cpu()
    vis = sq[:, None] == sk[None, :]
    if causal:
        vis &= kv_pos.cpu()[None, :] <= q_pos.cpu()[:, None]
    vis &= (qb[:, None] == kb[None, :]) | (qb[:, None] == -1) | (kb[None, :] == -1)
    return _dense(q, k, v, vis.to(q.device), scale)


def paged_attention(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale=None):
    op = _op("paged_attention")
    if op is not None:
        return op(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ps = k_cache.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    cq = cu_seqlens_q.tolist()
    for b in range(len(cq) - 1):
        n = int(kv_lens[b])
        slots = torch.arange(n, device=q.device)
        pages = block_table[b].long()[slots // ps]
        kk, vv = k_cache[pages, slots % ps], v_cache[pages, slots % ps]
        rows = slice(cq[b], cq[b + 1])
        vis = slots[None, :] <= q_pos[rows].long()[:, None]
        out[rows], lse[rows] = _dense(q[rows], kk, vv, vis, scale)
    return out, lse


def _rotate(x, delta, inv_freq, rotary_dim, interleaved):
    """x [N, H, D] rotated by delta [N] positions (fp32 math)."""
    ang = delta.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    xf = x.float()
    r = xf[..., :rotary_dim]
    if interleaved:
        a, b = r[..., 0::2], r[..., 1::2]
        o = torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)
    else:
        h = rotary_dim // 2
        a, b = r[..., :h], r[..., h:]
        o = torch.cat((a * cos - b * sin, a * sin + b * cos), -1)
    return torch.cat((o, xf[..., rotary_dim:]), -1).to(x.dtype)


def copy_kv_(dst_k, dst_v, src_k, src_v, src_rows, dst_rows, delta=None, inv_freq=None,
             rotary_dim=0, interleaved=False):
    op = _op("copy_kv_")
    if op is not None:
        return op(dst_k, dst_v, src_k, src_v, src_rows, dst_rows, delta, inv_freq, rotary_dim, interleaved)
    for dk, dv, sk, sv in zip(dst_k, dst_v, src_k, src_v):
        h, d = sk.shape[-2], sk.shape[-1]
        skf, svf = sk.reshape(-1, h, d), sv.reshape(-1, h, d)
        dkf, dvf = dk.view(-1, h, d), dv.view(-1, h, d)
        kk = skf[src_rows.long()]
        if delta is not None:
            kk = _rotate(kk, delta, inv_freq, rotary_dim, interleaved)
        dkf[dst_rows.long()] = kk
        dvf[dst_rows.long()] = svf[src_rows.long()]
