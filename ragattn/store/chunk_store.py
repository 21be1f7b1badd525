"""The chunk KV store: precomputed per-chunk KV caches for one model, in a bounded memory pool, on
disk and on a fleet's remote tier, served to requests by copy or in place.

    from ragattn.store import ChunkStore
    store = ChunkStore(model, directory="kv/")          # directory optional (memory only)
    keys = store.add([tok_ids_a, tok_ids_b, ...])       # one batched independent prefill of the misses
    req = store.assemble(keys, positions="reordered", extra_slots=64)   # copy: req.cache a kv.PagedKV
    with store.request(keys, positions="reordered", extra_slots=64) as req:   # zero copy: kv.TaggedPagedKV
        ...
    store.gather_into_(keys, dst_k, dst_v, dst_rows, positions)        # into any caller cache
    store.put(key, variant, k_layers, v_layers); store.get_kv(key); store.has(key); store.save(key)

``ChunkStore`` is a thin front (model following, keys, lookups) over the parts it composes: the
:class:`~ragattn.store.page_pool.PagePool`, the :class:`~ragattn.store.resident.ResidentSet` over it
(entries, LRU, pins), the :class:`~ragattn.store.loader.Loader` (the miss policy: memory, disk,
remote, recompute) over the :class:`~ragattn.store.disk_tier.DiskTier` and the
:class:`~ragattn.store.remote_tier.RemoteTier`, and the request builders
(:class:`~ragattn.store.copy_out.CopyOutBuilder`, :class:`~ragattn.store.zero_copy.ZeroCopyBuilder`).
docs/chunk-store.md is the long form (keys and fingerprints, memory, on disk, remote tier).
"""
from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import Sequence

import torch

from ragattn.store.copy_out import AssembledRequest, CopyOutBuilder
from ragattn.store.disk_tier import DiskTier
from ragattn.store.errors import ChunkStoreError
from ragattn.store.fingerprint import chunk_key, key_list, model_fingerprint, variant_key
from ragattn.store.loader import Loader
from ragattn.store.model import ChunkModel, describe_model
from ragattn.store.page_pool import PagePool, default_budget
from ragattn.store.remote_tier import RemoteTier
from ragattn.store.resident import ResidentSet
from ragattn.store.zero_copy import ZeroCopyBuilder, ZeroCopyRequest


class ChunkStore:
    """Precomputed chunk KV caches for one model (see the module docstring).

    ``model``: a :class:`~ragattn.store.model.ChunkModel`, or a model a registered describer knows
    (a HuggingFace model once ``ragattn.hf`` is imported).
    ``directory``: the disk tier (created if missing; must be writable unless ``read_only``).
    ``page_size``: rows per page of the pool and of assembled request caches.
    ``max_batch_tokens``: tokens per packed prefill of missing chunks.
    ``memory_budget``: bytes of K/V the in-memory pool may hold (default :func:`default_budget`).
    ``read_only``: never write to ``directory`` (chunks computed here stay in memory only).
    ``fingerprint=``, ``device=`` (with a model, not a description): computed elsewhere, for a model
    whose parameters are not materialised; such a store does not follow the model's weights.
    ``remote``: the remote tier shared by a fleet: a ``redis://``/``rediss://`` URL or a
    :class:`~ragattn.store.remote_tier.RemoteTier`; ``remote_secret``: its HMAC key (default: the
    ``RAGATTN_REMOTE_SECRET`` environment variable; bytes or str of at least 16 bytes);
    ``remote_options``: keyword arguments of :class:`RemoteTier` (``timeout``, ``retry_after``,
    ``max_value_bytes``, ``prefix``, ``client_options``), checked here.
    ``costs``: a :class:`~ragattn.store.cost.TierCosts` (e.g. ``TierCosts.measure(model)``): an
    evicted or added chunk is recomputed instead of read from a tier when that is modelled cheaper
    (default: the tiers first, always; docs/chunk-store.md, "Tier or recompute")."""

    def __init__(self, model, directory: str | os.PathLike | None = None, page_size: int = 16,
                 max_batch_tokens: int = 8192, *, memory_budget: int | None = None,
                 read_only: bool = False, fingerprint: str | None = None, device=None,
                 remote=None, remote_secret=None, remote_options: dict | None = None, costs=None):
        for name, value in (("page_size", page_size), ("max_batch_tokens", max_batch_tokens)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ChunkStoreError(f"ragattn.ChunkStore: {name} must be an integer >= 1, got {value!r}")
        page_size, max_batch_tokens = int(page_size), int(max_batch_tokens)
        d = describe_model(model, fingerprint, device)
        self.description: ChunkModel = d
        self.model = d.model                       # the described model, if the description keeps one
        self.config = getattr(d.model, "config", None)
        self.rope, self.fingerprint = d.rope, d.fingerprint
        self.num_layers, self.num_kv_heads, self.head_dim = d.num_layers, d.num_kv_heads, d.head_dim
        self.max_positions, self.vocab_size = d.max_positions, d.vocab_size
        self.dtype, self.device = d.dtype, d.device
        self.page_size, self.max_batch_tokens = page_size, max_batch_tokens
        self.read_only = bool(read_only)
        self.directory = Path(directory) if directory is not None else None
        layout = (self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)
        disk = None if directory is None else DiskTier(directory, self.read_only, layout)
        budget = default_budget(self.device) if memory_budget is None else int(memory_budget)
        self._pool = PagePool(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.device,
                              page_size, budget, self.max_positions)
        self.row_bytes = self._pool.row_bytes
        self.memory_budget = budget
        # counters: chunks computed, recomputed after eviction, loaded from disk; entries evicted;
        # weight changes followed; bad files (truncated, corrupt) replaced or dropped
        self.stats = {"computed": 0, "recomputed": 0, "loaded": 0, "evicted": 0, "weight_changes": 0,
                      "bad_files": 0}
        if remote is not None:
            if not isinstance(remote, RemoteTier):
                secret = remote_secret if remote_secret is not None else os.environ.get("RAGATTN_REMOTE_SECRET")
                remote = RemoteTier.from_options(remote, secret, remote_options)
            self.stats.update(remote.stats)     # one counter dict: remote_hits, _published, _bad, _errors
            remote.stats = self.stats
        self._resident = ResidentSet(self._pool, self.rope, self.stats)
        self._loader = Loader(d, self._resident, disk, remote, self.stats, max_batch_tokens, costs)
        self._copy_out = CopyOutBuilder(self._resident, self._loader.pin)
        self._zero_copy = ZeroCopyBuilder(self._resident, self._loader.pin)

    # ----- the model's weights ------------------------------------------------------------
    def _sync(self) -> None:
        """Follow the model: when its fingerprint changed since the last call (weights edited in
        place, a config change; see :func:`model_fingerprint` for what the cached check sees),
        every entry computed with the old weights leaves memory and later keys use the new one."""
        spec = self.description.current()
        if spec.fingerprint != self.fingerprint:
            self._weights_changed(spec)

    def refresh(self) -> str:
        """Checksum every weight byte (``model_fingerprint(cached=False)``: also sees ``.data``
        writes the per-call check cannot, e.g. to one element or to CUDA memory) and follow the
        model if it changed; returns the fingerprint."""
        spec = self.description.current(full=True)
        if spec.fingerprint != self.fingerprint:
            self._weights_changed(spec)
        return self.fingerprint

    def _weights_changed(self, spec: ChunkModel) -> None:
        if self._resident.any_pinned():
            raise ChunkStoreError("ragattn.ChunkStore: the model's weights changed during a gather or while "
                                  "a live zero-copy request holds chunks of the store (release it first)")
        self._loader.weights_changed(spec)
        self.description = spec
        self.fingerprint = spec.fingerprint
        self.rope = spec.rope
        self.stats["weight_changes"] += 1

    def check_model(self, model, where: str) -> None:
        """For the methods: ``model`` must be this store's model (then the store follows its
        current weights) or one with the same fingerprint, else ChunkStoreError."""
        if model is self.model:
            self._sync()
        elif self.fingerprint != model_fingerprint(model):
            self._sync()
            if self.fingerprint != model_fingerprint(model):
                raise ChunkStoreError(f"{where}: the ChunkStore was built for another model (fingerprint "
                                      "mismatch)")

    # ----- lookup ---------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return key in self._resident.entries

    def __len__(self) -> int:
        return len(self._resident.entries)

    def key(self, tokens) -> str:
        """Key of a chunk: ``tokens`` a sequence of ids or an int tensor."""
        self._sync()
        return chunk_key(self.fingerprint, tokens)

    def variant_key(self, key: str, variant: str) -> str:
        """Key of the derived entry ``variant`` (a name, e.g. "fused-...") of the chunk ``key``."""
        self._sync()
        return variant_key(self.fingerprint, key, variant)

    def variant_keys(self, keys: Sequence[str], variant: str) -> list[str]:
        """:meth:`variant_key` of each key, the model checked once (a method asking for every
        chunk of a prompt pays one check, not one per chunk)."""
        keys = key_list(keys, "ragattn.ChunkStore.variant_keys")
        self._sync()
        return [variant_key(self.fingerprint, k, variant) for k in keys]

    def has(self, key: str) -> bool:
        """Whether ``key`` is in memory, or on disk in the store's directory as a complete file of
        the model's current weights (its header and size are checked; nothing is loaded)."""
        self._sync()
        return self._loader.has(key)

    def lookup(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`has` of each key."""
        keys = key_list(keys, "ragattn.ChunkStore.lookup")
        self._sync()
        return [self._loader.has(k) for k in keys]

    def verify(self, key: str) -> bool:
        """Like :meth:`has`, but a file is read whole and checked (checksum included) first; a bad
        one is removed (``has`` turns False). For resuming an offline build: what exists is
        checked, not trusted. Nothing is loaded into the pool, except a chunk found only on the
        remote tier (fetched, verified and kept, so that a resumed build never computes it again)."""
        self._sync()
        return self._loader.verify(key)

    def tokens(self, key: str) -> torch.Tensor:
        self._sync()
        return self._loader.tokens_of(key)

    # ----- chunks in ---------------------------------------------------------------------------
    @torch.no_grad()
    def add(self, chunks: Sequence[Sequence[int]]) -> list[str]:
        """Store the KV of every chunk (token id lists or int tensors); returns their keys in order.

        Chunks already in memory or on disk are not recomputed (disk hits are loaded, then the
        remote tier's); the rest are prefilled together (packed, one independent sequence per
        chunk) in batches of ``max_batch_tokens`` tokens, each written to the directory before it
        enters the pool. On an error no chunk is left half-added (each is in memory and on disk,
        or absent). Adding more than the budget holds evicts the least recently used chunks (also
        from this call)."""
        self._sync()
        return self._loader.add(chunks)

    def put(self, key: str, variant: str, k_layers: Sequence[torch.Tensor],
            v_layers: Sequence[torch.Tensor]) -> str:
        """Store a derived entry of the chunk ``key`` (which must be in the store); returns its key.

        ``k_layers``, ``v_layers``: per layer ``[n, Hkv, D]`` (``n`` = the chunk's tokens), keys
        rotated at the chunk's local positions ``0..n-1``. Written to the directory, if any,
        before it enters the pool; an existing entry of that variant is replaced."""
        self._sync()
        return self._loader.put(key, variant, k_layers, v_layers)

    def load(self, key_or_path: str | os.PathLike) -> str:
        """Load and verify one chunk file (by key in the store's directory, or by path); returns its key."""
        self._sync()
        return self._loader.load(key_or_path)

    # ----- chunks out --------------------------------------------------------------------------
    def save(self, key: str, directory: str | os.PathLike | None = None) -> Path:
        """Write a chunk to ``<directory>/<key>.safetensors`` atomically; returns the path."""
        self._sync()
        return self._loader.save(key, directory)

    def get_kv(self, key: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K, V of a stored chunk: per layer ``[n, Hkv, D]`` copies, keys rotated to the chunk's
        local positions ``0..n-1`` (the pool holds them page-local: rotated here, in fp32)."""
        self._sync()
        return self._resident.read_local(self._loader.get(key))

    def kv(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of a stored chunk: ``[L, n, Hkv, D]`` each (copies; keys at local positions)."""
        k, v = self.get_kv(key)
        return torch.stack(k), torch.stack(v)

    @torch.no_grad()
    def gather_into_(self, keys: Sequence[str], dst_k: Sequence[torch.Tensor], dst_v: Sequence[torch.Tensor],
                     dst_rows: torch.Tensor, positions: torch.Tensor | None = None, *, skip: int = 0,
                     split_heads: bool = False, heads: range | None = None, layers: range | None = None) -> None:
        """Write the chunks ``keys`` (in order) into a caller's cache at ``dst_rows``, keys rotated
        to ``positions`` (:meth:`CopyOutBuilder.gather_into_`; ``heads``: with ``split_heads``, only
        these KV heads, e.g. a tensor-parallel rank's; ``layers``: only these layers, e.g. a
        pipeline-parallel stage's)."""
        keys = key_list(keys, "ragattn.ChunkStore.gather_into_")
        self._sync()
        self._copy_out.gather_into_(keys, dst_k, dst_v, dst_rows, positions, skip=skip, split_heads=split_heads,
                                    heads=heads, layers=layers)

    @torch.no_grad()
    def assemble(self, keys: Sequence[str], positions: str = "reordered", extra_slots: int = 0,
                 rerotate: bool = True, page_size: int | None = None) -> AssembledRequest:
        """The chunks (in this order) copied into a fresh paged request cache
        (:meth:`CopyOutBuilder.assemble`)."""
        keys = key_list(keys, "ragattn.ChunkStore.assemble")
        self._sync()
        return self._copy_out.assemble(keys, positions, extra_slots, rerotate, page_size)

    @torch.no_grad()
    def request(self, keys: Sequence[str], positions="reordered", extra_slots: int = 0) -> ZeroCopyRequest:
        """A zero-copy request over the chunks' own pool pages, pinned until released
        (:meth:`ZeroCopyBuilder.request`)."""
        keys = key_list(keys, "ragattn.ChunkStore.request")
        self._sync()
        return self._zero_copy.request(keys, positions, extra_slots)

    # ----- the pool ----------------------------------------------------------------------------
    @property
    def pool_bytes(self) -> int:
        """Bytes of K/V the pool has allocated (all slabs); never above ``memory_budget``."""
        return self._pool.pool_bytes

    @property
    def num_rows(self) -> int:
        """Tokens of every chunk in memory."""
        return self._resident.num_rows

    @property
    def pool_rows(self) -> int:
        """Rows the pool has allocated (``pool_bytes / row_bytes``), the rows of :meth:`pooled_kv`."""
        return self._pool.pool_rows

    def pool_offsets(self, rows: torch.Tensor) -> torch.Tensor:
        """The pool's one rule for keys: pool row ``r`` holds its key rotated by its offset in its
        page (:meth:`ResidentSet.pool_offsets`)."""
        return self._resident.pool_offsets(rows)

    def pooled_kv(self, device: str | torch.device = "cpu", pin_memory: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the whole in-memory pool, e.g. to keep the chunk KV in host memory.

        Returns K, V: ``[L, pool_rows, Hkv, D]`` each (every allocated pool row, the slabs in
        order; rows of free pages hold garbage), in the model's dtype, on ``device``;
        ``pin_memory=True`` (CPU ``device`` only, needs CUDA) allocates them in page-locked
        memory so that :meth:`load_pooled_kv_` can copy them to the GPU asynchronously. The copy
        is only meaningful to this store while no chunk is added, evicted or overwritten.
        Keys are in the pool's form: each rotated by its row's offset in its page
        (:meth:`get_kv` rotates them to their local positions)."""
        self._sync()
        return self._resident.pooled_kv(device, pin_memory)

    def load_pooled_kv_(self, k: torch.Tensor, v: torch.Tensor, non_blocking: bool = False) -> None:
        """Overwrite the in-memory pool with ``k``, ``v`` from :meth:`pooled_kv` (any device).

        ``k``, ``v``: ``[L, pool_rows, Hkv, D]`` in the store's dtype, copied from this store
        since its last change: after a chunk was added, evicted or overwritten the copy is stale
        (``ChunkStoreError``). ``non_blocking=True`` with pinned host tensors makes the
        host-to-device copies asynchronous (ordered on the current stream before later kernels)."""
        self._sync()
        self._resident.load_pooled_kv_(k, v, non_blocking)
