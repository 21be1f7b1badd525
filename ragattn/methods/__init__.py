"""RAG methods on top of ragattn's ops and chunk store: TurboRAG, Block-Attention, FusionRAG
(+ CacheBlend, Full Reuse), RAPID, REFRAG.

The API the demo and benchmarks call (every method has the same signature and result):

    from ragattn.methods import turborag, block_attention, full_prefill
    res = block_attention.answer(model, tokenizer, chunks, question, max_new_tokens=32, store=store)
    res = turborag.answer(model, tokenizer, chunks, question, positions="composite", store=store)
    res = full_prefill(model, tokenizer, chunks, question, max_new_tokens=32)
    res.tokens, res.text, res.ttft_s, res.total_s, res.first_logits   # see Answer

``chunks``: retrieved passages in prompt order, each a ``str`` (tokenized alone, no special
tokens) or a list of token ids. ``store``: a :class:`~ragattn.store.ChunkStore` for
this model (created on the fly if ``None``; pass one to reuse precomputed chunks across calls:
a warm store is the point of these methods). The prompt is ``head + chunk_1 + ... + chunk_k +
tail`` where ``head``/``tail`` come from the tokenizer's chat template around
"Documents: ... Question: {question}" (see :func:`prompt_parts`); the head is cached like a chunk
(its own block at position 0), the tail (question + assistant header) is the final block.

Modules: :mod:`.prompt` (prompt layout), :mod:`.generate` (:class:`Answer`, decoding over a paged
request cache), :mod:`.cached_answer` (TurboRAG / Block-Attention's shared path), :mod:`.baseline`
(:func:`full_prefill`); the chunk store is :mod:`ragattn.store` (``ChunkStore`` is re-exported here).
Submodules load lazily, on first attribute access (``ragattn.methods.turborag`` ...).
"""
import importlib

_LAZY = {"full_prefill": "ragattn.methods.baseline", "Answer": "ragattn.methods.generate",
         "ChunkStore": "ragattn.store", "ChunkStoreError": "ragattn.store"}


def __getattr__(name):
    if name in _LAZY:
        if _LAZY[name] == "ragattn.store":
            importlib.import_module("ragattn.hf")   # ChunkStore(hf_model): ragattn.hf describes HF models to it
        return getattr(importlib.import_module(_LAZY[name]), name)
    try:
        return importlib.import_module(f"ragattn.methods.{name}")
    except ModuleNotFoundError as exc:
        raise AttributeError(f"module 'ragattn.methods' has no attribute {name!r}") from exc
