"""The chunk KV store: precomputed per-chunk KV caches for one model, in a bounded memory pool and
on disk, served to requests by copy (``assemble``, ``gather_into_``) or in place (``request``).

    from ragattn.store import ChunkStore
    store = ChunkStore(model, "kv/")      # model: a ChunkModel, or a HF model once ragattn.hf is imported

One module per part:

* :mod:`.model`: :class:`ChunkModel`, what the store needs of a model (fingerprint, dimensions,
  RoPE, a prefill function); the HF side (:mod:`ragattn.hf.store_model`) and the vLLM side
  (:mod:`ragattn.vllm.store`) each provide one;
* :mod:`.fingerprint`: the model fingerprint and the chunk keys derived from it;
* :mod:`.page_pool`: the in-memory pool (byte budget, slabs of pages) and its allocator;
* :mod:`.resident`: the resident set over the pool (entries, page-local keys, LRU, pins);
* :mod:`.disk_tier`: the chunk files of a store directory (atomic writes, verified reads);
* :mod:`.remote_tier`: :class:`RemoteTier`, the same chunk files shared by a fleet on a Redis/Valkey
  server (split values, atomic publication, HMAC-authenticated);
* :mod:`.loader`: the miss policy (memory, disk, remote, recompute) and how chunks enter;
* :mod:`.cost`: :class:`TierCosts`, a tier read's cost against recomputing, by which the loader chooses;
* :mod:`.positions`: :class:`Positions`, the one position-scheme type of every request;
* :mod:`.copy_out`, :mod:`.zero_copy`: the request builders over the resident set;
* :mod:`.chunk_store`: :class:`ChunkStore`, the thin front composing them (model following, keys,
  lookups).

The store imports the op layer and the request KV layer (``ragattn.kv``: the caches its requests
fill), never the model patches, the methods, the engines or the apps
(tests/tooling/test_kernel_layering.py).
"""
from ragattn.store.chunk_store import ChunkStore
from ragattn.store.copy_out import AssembledRequest
from ragattn.store.cost import TIERS_FIRST, TierCosts
from ragattn.store.disk_tier import FORMAT, chunk_file, chunk_files
from ragattn.store.errors import ChunkStoreError
from ragattn.store.fingerprint import chunk_key, model_fingerprint, variant_key, weight_checksums
from ragattn.store.model import ChunkModel, Rope, describe_model, register_describer
from ragattn.store.page_pool import DEFAULT_BUDGET_FRACTION, default_budget
from ragattn.store.positions import Positions
from ragattn.store.remote_tier import RemoteTier
from ragattn.store.zero_copy import ZeroCopyRequest

__all__ = ["AssembledRequest", "ZeroCopyRequest", "ChunkStore", "ChunkStoreError", "ChunkModel", "Rope", "FORMAT", "chunk_file", "chunk_files",
           "DEFAULT_BUDGET_FRACTION", "Positions", "chunk_key", "default_budget", "describe_model", "model_fingerprint",
           "register_describer", "RemoteTier", "TIERS_FIRST", "TierCosts", "variant_key", "weight_checksums"]
