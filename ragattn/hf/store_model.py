"""A HuggingFace model described to the chunk store (:class:`ragattn.store.ChunkModel`).

    from ragattn.hf.store_model import describe
    store = ChunkStore(describe(model), "kv/")    # == ChunkStore(model, "kv/") once ragattn.hf is imported

Dimensions come from the config, RoPE from the model's own rotary module (:func:`ragattn.hf.rope.rope_params`),
the fingerprint from its config and weights (:func:`ragattn.store.model_fingerprint`), and chunks are
prefilled through the "ragattn" attention (one ``varlen_attention`` forward over the packed chunks,
K/V captured per layer). The description follows the model: when its weights change, the next store
call sees a new fingerprint and RoPE.
"""
from __future__ import annotations

import functools

import torch

from ragattn.hf.registration import use_ragattn
from ragattn.hf.rope import rope_params
from ragattn.store.fingerprint import model_fingerprint
from ragattn.store.model import ChunkModel, register_describer


def _prefill(model, ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor):
    """:data:`ragattn.store.model.Prefill` of ``model``: K/V per layer ``[T, Hkv, D]``."""
    capture: list = []
    base = getattr(model, "model", model)
    with use_ragattn(model):
        base(input_ids=ids[None], position_ids=positions[None], use_cache=False, ragattn_cu_seqlens=cu_seqlens,
             ragattn_capture=capture)
    return [k[0].transpose(0, 1) for k, _ in capture], [v[0].transpose(0, 1) for _, v in capture]


def _follow(spec: ChunkModel, full: bool) -> ChunkModel:
    fp = model_fingerprint(spec.model, cached=not full)
    if fp == spec.fingerprint:
        return spec
    return spec.replace(fingerprint=fp, rope=rope_params(spec.model))   # inv_freq is a buffer: it may change too


def describe(model, fingerprint: str | None = None, device=None, *, keep_model: bool = True) -> ChunkModel:
    """``model`` (a ``*ForCausalLM`` of a supported family) as a :class:`ChunkModel`.

    ``fingerprint``: computed elsewhere (e.g. from the checkpoint files, for a model whose parameters
    are not materialised: :mod:`ragattn.vllm.store`); the description then does not follow the
    weights. ``device``: where the store's pool lives (default: the parameters' device).
    ``keep_model=False``: a description that holds no reference to the model (no prefill: it serves
    chunk files only)."""
    rope = rope_params(model)
    config = model.config
    p = next(model.parameters())
    if fingerprint is None:
        fingerprint = model_fingerprint(model, cached=False)
        follow = _follow
    else:
        follow = None
    return ChunkModel(fingerprint=fingerprint, num_layers=config.num_hidden_layers,
                      num_kv_heads=config.num_key_value_heads, head_dim=rope.head_dim, dtype=p.dtype,
                      device=p.device if device is None else torch.device(device), rope=rope,
                      max_positions=int(getattr(config, "max_position_embeddings", 1 << 30)),
                      vocab_size=int(model.get_input_embeddings().num_embeddings),
                      prefill=functools.partial(_prefill, model) if keep_model else None,
                      follow=follow if keep_model else None, model=model if keep_model else None)


def _describe_hf(model, fingerprint, device):
    """The store's describer for transformers models (anything else: None)."""
    if not (isinstance(model, torch.nn.Module) and hasattr(model, "config") and hasattr(model, "get_input_embeddings")):
        return None
    return describe(model, fingerprint, device)


register_describer(_describe_hf)
