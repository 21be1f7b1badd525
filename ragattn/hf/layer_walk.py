"""The layer walk of a transformers Llama-family decoder (Llama, Qwen2, Mistral, Gemma 2/3, ...):
embed, rotary, one decoder layer at a time on the "ragattn" attention over a paged request
cache, norm, lm_head and the final logit softcap. The selective recompute's loop
(``ragattn.methods.selection.walk_layers``) drives it.

    base = decoder(model)                       # model.model, checked
    walk = HFLayerWalk(model, cache, ids, slots, positions=None, capture_query=None, query_only=False)
    walk_layers(walk, checks=..., num_candidates=...)       # (ragattn.methods.selection)
    walk.slots, walk.logits()                   # rows that ran through the last layer, last row's logits
"""
from __future__ import annotations

import inspect

import torch

from ragattn.hf.attention import QueryCaptured
from ragattn.hf.rope import rope_params


def decoder(model):
    """The decoder (``model.model``, or the model itself) whose embed, layers, norm and rotary the
    walk uses; NotImplementedError naming what a model lacks."""
    base = getattr(model, "model", model)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(base, name):
            raise NotImplementedError(f"ragattn.methods.fusionrag: {type(model).__name__} has no "
                                      f"'{name}' (a Llama/Qwen2/Mistral-style decoder is expected)")
    return base


def rope_layer_type(model, base) -> dict:
    """``{"layer_type": t}`` for a rotary module with one RoPE per layer type (Gemma 3), where
    ``ragattn.hf.rope.rope_params`` has checked that every type has the same frequencies (it
    raises otherwise); ``{}`` for the others."""
    if "layer_type" not in inspect.signature(base.rotary_emb.forward).parameters:
        return {}
    rope_params(model)
    return {"layer_type": model.config.layer_types[0]}


def final_logits(model, h_last: torch.Tensor) -> torch.Tensor:
    """float32 ``[vocab]`` logits of the hidden state ``h_last`` ``[1, 1, hidden]``: final norm,
    ``lm_head`` and the final logit softcap where the model has one (Gemma 2's, as its forward does)."""
    out = model.lm_head(decoder(model).norm(h_last))[0, -1].float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        out = cap * torch.tanh(out / cap)
    return out


class HFLayerWalk:
    """The tokens ``ids`` (int64 ``[n]``) through the model's layers, each writing its K/V at its
    slot ``slots`` (int ``[n]``) of the paged request ``cache`` (``ragattn_paged`` /
    ``ragattn_slots`` of the HF patch) at RoPE ``positions`` (default: the slots).
    ``capture_query``: a list that receives the last layer's query ``[1, Hq, rows, D]``; with
    ``query_only`` the walk stops once it has it (:meth:`run_layer` returns False)."""

    def __init__(self, model, cache, ids: torch.Tensor, slots: torch.Tensor, *, positions=None,
                 capture_query: list | None = None, query_only: bool = False):
        self.model, self.cache = model, cache
        self.base = base = decoder(model)
        self.slots = slots.to(torch.long)
        self.pos = (self.slots if positions is None else positions.to(torch.long))[None]
        self.h = base.embed_tokens(ids.reshape(1, -1))
        self.cos, self.sin = base.rotary_emb(self.h, self.pos, **rope_layer_type(model, base))
        self.num_layers = len(base.layers)
        self.capture_query, self.query_only = capture_query, query_only
        self._captured: list | None = None

    @property
    def rows(self) -> int:
        return self.slots.numel()

    def cached_kv(self, layer: int, n: int):
        return tuple(t.clone() for t in self.cache.read_kv(layer, self.slots[:n]))

    def run_layer(self, layer: int, capture_kv: bool) -> bool:
        kw = {}
        if layer == self.num_layers - 1 and self.capture_query is not None:
            kw["ragattn_capture_query"] = self.capture_query
            if self.query_only:
                kw["ragattn_query_only"] = True
        self._captured = None
        if capture_kv:
            kw["ragattn_capture"] = self._captured = []
        try:
            self.h = self.base.layers[layer](self.h, attention_mask=None, position_ids=self.pos,
                                             position_embeddings=(self.cos, self.sin), ragattn_paged=self.cache,
                                             ragattn_slots=self.slots, **kw)
        except QueryCaptured:   # (query_only: the last layer's query is all the caller needs)
            return False
        return True

    def fresh_kv(self, layer: int, n: int):
        k, v = self._captured[0]
        return k[0, :, :n].transpose(0, 1), v[0, :, :n].transpose(0, 1)

    def keep(self, rows: torch.Tensor) -> None:
        self.h, self.cos, self.sin = self.h[:, rows], self.cos[:, rows], self.sin[:, rows]
        self.pos, self.slots = self.pos[:, rows], self.slots[rows]

    def logits(self) -> torch.Tensor:
        """float32 ``[vocab]``: the last row's logits (:func:`final_logits`)."""
        return final_logits(self.model, self.h[:, -1:])


__all__ = ["HFLayerWalk", "decoder", "rope_layer_type", "final_logits"]
