"""The chunk KV store (the historical import path): everything lives in
:mod:`ragattn.methods.store` (fingerprint, page pool, disk tier, assembly); see
:mod:`ragattn.methods.store.chunk_store` for the documentation.

    from ragattn.methods import ChunkStore          # or: from ragattn.methods.chunk_store import ChunkStore
"""
from ragattn.methods.store import (  # noqa: F401  (re-exported)
    DEFAULT_BUDGET_FRACTION, FORMAT, AssembledRequest, ChunkStore, ChunkStoreError, chunk_key, default_budget,
    model_fingerprint, variant_key, weight_checksums, ZeroCopyRequest)

__all__ = ["AssembledRequest", "ZeroCopyRequest", "ChunkStore", "ChunkStoreError", "FORMAT", "DEFAULT_BUDGET_FRACTION",
           "chunk_key", "default_budget", "model_fingerprint", "variant_key", "weight_checksums"]
