"""RAG methods on top of ragattn's ops: the chunk KV store, TurboRAG, Block-Attention, ...

    from ragattn.methods import turborag, block_attention, full_prefill, ChunkStore
    res = block_attention.answer(model, tokenizer, chunks, question, store=ChunkStore(model))

Submodules load lazily, on first attribute access (``ragattn.methods.turborag`` ...).
"""
import importlib

_LAZY = {"full_prefill": "ragattn.methods.common", "Answer": "ragattn.methods.common",
         "ChunkStore": "ragattn.methods.chunk_store", "ChunkStoreError": "ragattn.methods.chunk_store"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    try:
        return importlib.import_module(f"ragattn.methods.{name}")
    except ModuleNotFoundError as exc:
        raise AttributeError(f"module 'ragattn.methods' has no attribute {name!r}") from exc
