"""Shared pieces of the cached-chunk methods: prompt layout, final-block prefill, greedy decode.

The API the demo and benchmarks call (every method has the same signature and result):

    from ragattn.methods import turborag, block_attention, full_prefill
    res = block_attention.answer(model, tokenizer, chunks, question, max_new_tokens=32, store=store)
    res = turborag.answer(model, tokenizer, chunks, question, positions="composite", store=store)
    res = full_prefill(model, tokenizer, chunks, question, max_new_tokens=32)
    res.tokens, res.text, res.ttft_s, res.total_s, res.first_logits   # see Answer

``chunks``: retrieved passages in prompt order, each a ``str`` (tokenized alone, no special
tokens) or a list of token ids. ``store``: a :class:`~ragattn.methods.chunk_store.ChunkStore` for
this model (created on the fly if ``None``; pass one to reuse precomputed chunks across calls:
a warm store is the point of these methods). The prompt is ``head + chunk_1 + ... + chunk_k +
tail`` where ``head``/``tail`` come from the tokenizer's chat template around
"Documents: ... Question: {question}" (see :func:`prompt_parts`); the head is cached like a chunk
(its own block at position 0), the tail (question + assistant header) is the final block.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from transformers import LogitsProcessor, LogitsProcessorList

from ragattn.hf.attention import use_ragattn
from ragattn.hf.attn_switch import attention_implementation

SYSTEM = "Answer the question using only the documents. Answer briefly."
_SENTINEL = "\u2063RAGATTN_DOCS\u2063"


@dataclass
class Answer:
    """Result of one answered question.

    ``tokens``: generated ids (greedy, stops after EOS or ``max_new_tokens``); ``text``: decoded;
    ``ttft_s``: seconds from the call to the first generated token (chunk lookup, assembly and
    final-block prefill included); ``total_s``: whole call; ``first_logits``: float32 ``[vocab]``
    logits of the first generated token; ``prompt_len``: prompt tokens."""
    tokens: list[int]
    text: str
    ttft_s: float
    total_s: float
    first_logits: torch.Tensor
    prompt_len: int
    method: str = ""
    extra: dict = field(default_factory=dict)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompt_parts(tokenizer, chunks: Sequence, question: str):
    """(head_ids, [chunk_ids...], tail_ids): lists of int token ids of the three prompt parts."""
    def ids(x):
        if isinstance(x, str):
            return tokenizer(x, add_special_tokens=False)["input_ids"]
        return [int(t) for t in x]

    user = f"Documents:\n{_SENTINEL}\nQuestion: {question}"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            tokenize=False, add_generation_prompt=True)
    else:
        text = f"{SYSTEM}\n\n{user}\nAnswer:"
    head, tail = text.split(_SENTINEL)
    return ids(head), [ids(c) for c in chunks], ids(tail)


def _eos_ids(model, tokenizer):
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return eos


@torch.no_grad()
def paged_forward(model, ids: torch.Tensor, positions: torch.Tensor, cache, logits_to_keep: int = 0) -> torch.Tensor:
    """Run ``ids`` ``[1, q]`` at RoPE ``positions`` ``[q]`` against a paged request cache (appending
    them) through ``ragattn.paged_attention``; returns float32 logits ``[q, vocab]``, or of the
    last ``logits_to_keep`` tokens only (``[logits_to_keep, vocab]``; 0 = all): the first token
    needs one row, and the LM head over all ``q`` rows costs a quarter of a 20-token prefill."""
    with use_ragattn(model):
        out = model(input_ids=ids, position_ids=positions[None].long(), use_cache=False,
                    ragattn_paged=cache, logits_to_keep=logits_to_keep)
    cache.lengths += ids.shape[1]
    return out.logits[0].float()


class _FirstStepClock(LogitsProcessor):
    """Notes the time when generate() has the first step's logits (the first token follows)."""

    def __init__(self, device):
        self.device, self.t = device, None

    def __call__(self, input_ids, scores):
        if self.t is None:
            _sync(self.device)
            self.t = time.perf_counter()
        return scores


def _generate(model, tokenizer, t0: float, method: str, prompt_len: int, new_from: int,
              max_new_tokens: int, generate_kwargs: dict, **inputs) -> Answer:
    """``model.generate(**inputs)`` (greedy unless ``generate_kwargs`` say otherwise; stops at the
    model's and tokenizer's EOS), timed from ``t0``; the Answer of row 0."""
    dev = next(model.parameters()).device
    clock = _FirstStepClock(dev)
    eos = sorted(_eos_ids(model, tokenizer))
    kw = dict(do_sample=False, eos_token_id=eos or None)
    if model.generation_config.pad_token_id is None:
        pad = getattr(tokenizer, "pad_token_id", None)
        kw["pad_token_id"] = pad if pad is not None else (eos[0] if eos else 0)
    kw.update(generate_kwargs)
    if not kw["do_sample"]:
        kw.update(temperature=None, top_p=None, top_k=None)   # silence sampling-flag warnings
    if "stop_strings" in kw:
        kw.setdefault("tokenizer", tokenizer)
    kw["logits_processor"] = LogitsProcessorList([clock, *kw.get("logits_processor", [])])
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, return_dict_in_generate=True,
                         output_logits=True, **kw)
    _sync(dev)
    total = time.perf_counter() - t0
    tokens = out.sequences[0, new_from:].tolist()
    eos = set(kw["eos_token_id"] or [])
    for i, t in enumerate(tokens):   # drop the padding after an early EOS
        if t in eos:
            tokens = tokens[: i + 1]
            break
    return Answer(tokens, tokenizer.decode(tokens, skip_special_tokens=True), clock.t - t0, total,
                  out.logits[0][0].float(), prompt_len, method)


@torch.no_grad()
def generate_paged(model, tokenizer, cache, final_ids, start_pos: int, max_new_tokens: int, t0: float,
                   method: str, prompt_len: int, cached_ids=None, cached_positions=None,
                   **generate_kwargs) -> Answer:
    """Prefill the final block ``final_ids`` at RoPE positions ``start_pos..`` against the paged
    request ``cache`` (a batch-1 :class:`~ragattn.hf.attention.PagedKV` holding ``lengths[0]``
    slots), then generate with ``model.generate()`` over a :class:`~ragattn.hf.cache.PagedCache`
    (greedy by default; ``generate_kwargs`` go to ``generate()``: sampling, logits processors,
    ``stop_strings``...). ``cached_ids`` / ``cached_positions``: the tokens and positions the
    cache holds (logits processors such as a repetition penalty read them; placeholders if absent).
    Builds the Answer (``ttft_s`` from ``t0`` to the first step's logits)."""
    from ragattn.hf.cache import PagedCache

    dev = next(model.parameters()).device
    seen = int(cache.lengths[0])
    if cached_ids is None:
        cached_ids = [getattr(tokenizer, "pad_token_id", None) or 0] * seen
    if cached_positions is None:
        cached_positions = torch.arange(seen)
    ids = torch.tensor([list(cached_ids) + list(final_ids)], device=dev)
    pos = torch.cat([torch.as_tensor(cached_positions, device=dev).long(),
                     start_pos + torch.arange(len(final_ids), device=dev)])[None]
    with use_ragattn(model):
        return _generate(model, tokenizer, t0, method, prompt_len, ids.shape[1], max_new_tokens,
                         generate_kwargs, input_ids=ids, attention_mask=torch.ones_like(ids),
                         position_ids=pos, past_key_values=PagedCache(cache, seen=seen), use_cache=True)


def cached_answer(model, tokenizer, chunks, question, *, positions: str, method: str,
                  max_new_tokens: int = 32, store=None, rerotate: bool = True, zero_copy: bool = True,
                  **generate_kwargs) -> Answer:
    """Answer from cached chunks (TurboRAG / Block-Attention). See the module docstring;
    ``generate_kwargs`` go to ``model.generate()`` (default: greedy). ``zero_copy`` (default):
    the request attends to the store's own chunk pages in place (``ChunkStore.request``: positions
    in its page table, RoPE in the kernel); False: the chunks are copied into a request cache with
    their keys rotated on the way (``ChunkStore.assemble``; ``rerotate=False`` is a copy-path
    option for tests)."""
    from ragattn.methods.chunk_store import ChunkStore, ChunkStoreError

    if len(chunks) == 0:
        raise ChunkStoreError(f"ragattn.methods.{method}: no chunks given (empty retrieval)")
    head, chunk_ids, tail = prompt_parts(tokenizer, chunks, question)
    if store is None:
        store = ChunkStore(model)
    else:   # the store's model (it follows its weights) or one with the same fingerprint
        store.check_model(model, f"ragattn.methods.{method}")
    with use_ragattn(model):  # switched outside the timed region
        t0 = time.perf_counter()
        keys = store.add([head] + chunk_ids)
        if zero_copy and rerotate:
            req = store.request(keys, positions=positions, extra_slots=len(tail) + max_new_tokens)
        else:
            req = store.assemble(keys, positions=positions, extra_slots=len(tail) + max_new_tokens,
                                 rerotate=rerotate)
        prompt_len = req.num_slots + len(tail)
        try:
            ans = generate_paged(model, tokenizer, req.cache, tail, req.next_position, max_new_tokens,
                                 t0, method, prompt_len, cached_ids=[t for c in [head] + chunk_ids for t in c],
                                 cached_positions=req.positions, **generate_kwargs)
        finally:
            if zero_copy and rerotate:
                req.release()
        if zero_copy and rerotate:
            ans.extra["private_bytes"] = req.private_bytes
        return ans


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
    ids_list = head + [t for c in chunk_ids for t in c] + tail
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and len(ids_list) + max_new_tokens > limit:
        raise ValueError(f"ragattn.methods.full_prefill: prompt of {len(ids_list)} tokens + "
                         f"{max_new_tokens} new tokens exceeds the model's window ({limit})")
    dev = next(model.parameters()).device
    if attn_implementation == "sdpa" and not getattr(model, "_supports_sdpa", True):
        attn_implementation = "eager"   # Gemma 2: transformers refuses SDPA (soft-capping)
    impl = attn_implementation or model.config._attn_implementation
    # shared with the other threads that run this model (ragattn.hf.attn_switch)
    with attention_implementation(model, impl, lambda m, old, new: m.set_attn_implementation(new)):
        t0 = time.perf_counter()
        ids = torch.tensor([ids_list], device=dev)
        return _generate(model, tokenizer, t0, "full_prefill", len(ids_list), len(ids_list), max_new_tokens,
                         generate_kwargs, input_ids=ids, attention_mask=torch.ones_like(ids))
