"""The baseline every method is measured against: the whole prompt (the same tokens as the cached
methods, :mod:`ragattn.methods.prompt`) prefilled with full causal attention, then
``model.generate()`` with the model's own KV cache."""
from __future__ import annotations

import time

import torch

from ragattn.hf.attn_switch import attention_implementation
from ragattn.methods.generate import Answer, _generate
from ragattn.methods.prompt import prompt_parts

@torch.no_grad()
def full_prefill(model, tokenizer, chunks, question, max_new_tokens: int = 32, store=None,
                 attn_implementation: str | None = "sdpa", **generate_kwargs) -> Answer:
    """Baseline: prefill the whole prompt (same tokens as the cached methods) with full causal
    attention, then ``model.generate()`` with the model's own KV cache (greedy unless
    ``generate_kwargs`` say otherwise). ``store`` is ignored. ``attn_implementation``: the
    attention used ("sdpa" default, "ragattn", or None = the model's)."""
    if len(chunks) == 0:
        raise ValueError("ragattn.methods.full_prefill: no chunks given (empty retrieval)")
    head, chunk_ids, tail = prompt_parts(tokenizer, chunks, question)
    return _prefill_answer(model, tokenizer, head + [t for c in chunk_ids for t in c] + tail, max_new_tokens,
                           attn_implementation, generate_kwargs, "full_prefill")


@torch.no_grad()
def no_context(model, tokenizer, chunks, question, max_new_tokens: int = 32, store=None,
               attn_implementation: str | None = "sdpa", **generate_kwargs) -> Answer:
    """The floor of every RAG method: the model answers the question from the same prompt layout
    with no documents at all (``chunks`` and ``store`` are ignored), by :func:`full_prefill`'s path."""
    head, _, tail = prompt_parts(tokenizer, [], question)
    return _prefill_answer(model, tokenizer, head + tail, max_new_tokens, attn_implementation, generate_kwargs,
                           "no_context")


def _prefill_answer(model, tokenizer, ids_list, max_new_tokens, attn_implementation, generate_kwargs, name):
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and len(ids_list) + max_new_tokens > limit:
        raise ValueError(f"ragattn.methods.{name}: prompt of {len(ids_list)} tokens + "
                         f"{max_new_tokens} new tokens exceeds the model's window ({limit})")
    dev = next(model.parameters()).device
    if attn_implementation == "sdpa" and not getattr(model, "_supports_sdpa", True):
        attn_implementation = "eager"   # Gemma 2: transformers refuses SDPA (soft-capping)
    impl = attn_implementation or model.config._attn_implementation
    # shared with the other threads that run this model (ragattn.hf.attn_switch)
    with attention_implementation(model, impl, lambda m, old, new: m.set_attn_implementation(new)):
        t0 = time.perf_counter()
        ids = torch.tensor([ids_list], device=dev)
        return _generate(model, tokenizer, t0, name, len(ids_list), len(ids_list), max_new_tokens,
                         generate_kwargs, input_ids=ids, attention_mask=torch.ones_like(ids))
