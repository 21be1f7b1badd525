"""What the "ragattn" attention does not compute with ragattn's kernels: the features it refuses by
name, and the model's own attention (SDPA for a custom mask, eager for attention weights)."""
from __future__ import annotations

import torch

from ragattn.hf.rope import SUPPORTED_FAMILIES  # the families whose attention modules are checked


def _soft_cap(module, kwargs) -> float:
    """The layer's attention-logit soft cap (Gemma 2's ``attn_logit_softcapping``, passed by its
    attention module as ``softcap``), 0.0 for none: ``logits_soft_cap`` of the ops."""
    cap = kwargs.get("softcap")
    if cap is None:
        cap = getattr(getattr(module, "config", None), "attn_logit_softcapping", None)
    return float(cap) if cap else 0.0


def _refuse_unsupported(module, dropout, kwargs) -> None:
    """Named errors for every attention feature this path does not implement."""
    config = getattr(module, "config", None)
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise NotImplementedError(
            f"ragattn attention: model family {family!r} is not supported (supported: "
            f"{sorted(SUPPORTED_FAMILIES)}); use attn_implementation='sdpa' for it")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError("ragattn attention: attention sinks (s_aux) are not supported")
    if dropout and module.training:
        raise NotImplementedError("ragattn attention: dropout is not supported")
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        raise NotImplementedError("ragattn attention: non-causal attention is not supported")


def _sdpa_fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    if _soft_cap(module, kwargs):   # SDPA cannot soft-cap: the model's eager attention (its mask as given)
        return _eager_forward(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs = {k: v for k, v in kwargs.items() if not k.startswith("ragattn_")}
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


def _eager_forward(module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """``output_attentions=True``: the call runs the model's own eager attention (its modeling
    file's ``eager_attention_forward``: soft-capping and all), which forms the weights ragattn's
    kernels never materialise; what SDPA code gets from ``attn_implementation="eager"``. The mask
    comes from ragattn's (SDPA's) mask builder: boolean, or None for SDPA's ``is_causal``, made
    additive here as eager expects."""
    import sys

    if kwargs.get("output_attentions") and (getattr(key, "_ragattn_cache", None) is not None or any(
            kwargs.get(k) is not None for k in ("ragattn_paged", "ragattn_cu_seqlens", "ragattn_block_ids"))):
        raise NotImplementedError("ragattn attention: output_attentions=True with ragattn's paged, packed or "
                                  "block-attention inputs (the weights are never formed there)")
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as eager
    q, kv = query.shape[2], key.shape[2]
    mask = attention_mask
    if mask is None and q > 1:      # SDPA's is_causal: top-left aligned
        mask = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril()[None, None]
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~mask, torch.finfo(query.dtype).min)
    kwargs = {k: v for k, v in kwargs.items() if not k.startswith("ragattn_")}
    out, weights = eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    return out, weights if kwargs.get("output_attentions") else None
