"""The chunk KV store, one module per part:

* :mod:`.fingerprint`: the model fingerprint and the chunk keys derived from it;
* :mod:`.page_pool`: the in-memory pool (byte budget, slabs of pages) and its allocator;
* :mod:`.disk_tier`: the safetensors files of a store directory (atomic writes, verified reads);
* :mod:`.chunk_store`: :class:`ChunkStore` (prefill of missing chunks, LRU, request assembly).

``ragattn.methods.chunk_store`` re-exports the public names (the historical import path).
"""
from ragattn.methods.store.chunk_store import AssembledRequest, ChunkStore, ZeroCopyRequest
from ragattn.methods.store.disk_tier import FORMAT
from ragattn.methods.store.errors import ChunkStoreError
from ragattn.methods.store.fingerprint import chunk_key, model_fingerprint, variant_key, weight_checksums
from ragattn.methods.store.page_pool import DEFAULT_BUDGET_FRACTION, default_budget

__all__ = ["AssembledRequest", "ZeroCopyRequest", "ChunkStore", "ChunkStoreError", "FORMAT", "DEFAULT_BUDGET_FRACTION",
           "chunk_key", "default_budget", "model_fingerprint", "variant_key", "weight_checksums"]
