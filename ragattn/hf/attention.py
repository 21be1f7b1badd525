"""ragattn as a transformers attention implementation ("ragattn").

    import ragattn.hf.attention          # registers "ragattn" (also done by ragattn.hf.enable())
    model.set_attn_implementation("ragattn")            # or from_pretrained(..., attn_implementation="ragattn")
    model.generate(**tok(texts, return_tensors="pt", padding=True), do_sample=False)

Registered in both ``AttentionInterface`` (the attention function) and ``AttentionMaskInterface``
(the mask builder: transformers' boolean SDPA mask, so padded batches get their mask, or ``None``
for an unpadded causal batch). Per layer call, with ``query [B, Hq, q, D]`` and the updated
contiguous cache ``key/value [B, Hkv, kv, D]`` (slot ``j`` holds position ``j`` of the row):

* ``q > 1`` (prefill, chunked prefill): the valid (non-pad) queries and keys are packed and run
  through ``ragattn.varlen_attention`` with ``q_pos``/``kv_pos`` = cache slots (causal by slot).
* ``q == 1`` (decode): ``ragattn.paged_attention``; unpadded: one page per row (the contiguous
  special case), padded: pages of one slot listing only the row's valid slots.

Block-Attention: pass ``ragattn_block_ids`` (int ``[B, kv]``, block id of every cache slot incl.
the current tokens, ``-1`` = global) through ``model(..., ragattn_block_ids=...)``; the prefill then
uses the Block-Attention mask (same block or either side global).
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ragattn.methods import _ops

NAME = "ragattn"


def _valid_from_mask(mask, b, q, kv, device):
    """(q_valid [B, q], kv_valid [B, kv]) bool from a boolean/additive mask [B, 1|H, q, kv] or None."""
    if mask is None:
        return (torch.ones(b, q, dtype=torch.bool, device=device),
                torch.ones(b, kv, dtype=torch.bool, device=device))
    m = mask if mask.dtype == torch.bool else mask == 0
    m = m[:, 0].expand(b, q, kv)
    return m.any(-1), m.any(-2)


def ragattn_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                              is_causal=None, **kwargs):
    """HF attention function: returns ``(out [B, q, Hq, D], None)``."""
    if dropout and module.training:
        raise NotImplementedError("ragattn attention: dropout is not supported")
    b, hq, q, d = query.shape
    kv, hkv = key.shape[2], key.shape[1]
    dev = query.device
    window = getattr(module, "sliding_window", None) or kwargs.get("sliding_window")
    if window is not None and kv > window:
        raise NotImplementedError(f"ragattn attention: sliding-window attention (window {window}) "
                                  f"over {kv} keys is not supported")
    q_valid, kv_valid = _valid_from_mask(attention_mask, b, q, kv, dev)
    block_ids = kwargs.get("ragattn_block_ids")
    qt, kt, vt = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, T, H, D]
    out = torch.zeros(b, q, hq, d, dtype=query.dtype, device=dev)
    if q == 1 and block_ids is None:
        n = kv_valid.sum(1).to(torch.int32)                       # valid keys per row
        if bool(kv_valid.all()):
            k_cache, v_cache = kt.contiguous(), vt.contiguous()   # [B, kv, Hkv, D]: one page per row
            table = torch.arange(b, dtype=torch.int32, device=dev)[:, None]
        else:
            k_cache = kt.reshape(b * kv, 1, hkv, d).contiguous()
            v_cache = vt.reshape(b * kv, 1, hkv, d).contiguous()
            slots = torch.arange(kv, device=dev).expand(b, kv)
            order = torch.sort((~kv_valid).to(torch.int8), dim=1, stable=True).indices  # valid first
            table = ((torch.arange(b, device=dev)[:, None] * kv) + slots.gather(1, order)).to(torch.int32)
        cu = torch.arange(b + 1, dtype=torch.int32, device=dev)
        o, _ = _ops.paged_attention(qt[:, 0].contiguous(), (n - 1).clamp_min(0), cu, k_cache, v_cache,
                                    table, n, scaling)
        out[:, 0] = o
        return out, None
    slot_k = torch.arange(kv, dtype=torch.int32, device=dev).expand(b, kv)
    slot_q = slot_k[:, kv - q:]
    cu_q = torch.zeros(b + 1, dtype=torch.int32, device=dev)
    cu_k = torch.zeros(b + 1, dtype=torch.int32, device=dev)
    cu_q[1:] = q_valid.sum(1).cumsum(0)
    cu_k[1:] = kv_valid.sum(1).cumsum(0)
    q_block = kv_block = None
    if block_ids is not None:
        block_ids = block_ids.to(device=dev, dtype=torch.int32)
        kv_block = block_ids[kv_valid].contiguous()
        q_block = block_ids[:, kv - q:][q_valid].contiguous()
    o, _ = _ops.varlen_attention(
        qt[q_valid].contiguous(), kt[kv_valid].contiguous(), vt[kv_valid].contiguous(), cu_q, cu_k,
        slot_q[q_valid].contiguous(), slot_k[kv_valid].contiguous(), q_block, kv_block, True, scaling)
    out[q_valid] = o
    return out, None


def register() -> None:
    """Register "ragattn" with transformers (idempotent)."""
    AttentionInterface.register(NAME, ragattn_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
