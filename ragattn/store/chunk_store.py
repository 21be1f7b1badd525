"""The chunk KV store: precomputed per-chunk KV caches, in a bounded memory pool and on disk.

    from ragattn.store import ChunkStore
    store = ChunkStore(model, directory="kv/")          # directory optional (memory only)
    keys = store.add([tok_ids_a, tok_ids_b, ...])       # one batched independent prefill of the misses
    req = store.assemble(keys, positions="reordered", extra_slots=64)
    # req.cache: ragattn.kv.PagedKV holding the chunks' K/V at their request slots,
    # keys re-rotated to their request positions; req.next_position: RoPE position after the chunks.

``model``: a :class:`~ragattn.store.model.ChunkModel` (what the store needs of a model:
fingerprint, dimensions, RoPE, a prefill function), or a model that a registered describer turns
into one: a HuggingFace model once ``ragattn.hf`` is imported (:mod:`ragattn.hf.store_model`),
whose chunks are computed by one ``varlen_attention`` forward over all missing chunks packed (one
sequence per chunk, positions 0..n-1 per chunk). The pool keeps each chunk's keys *page-local*
(a row's key rotated by its offset in its page, ``row % page_size``: rotated once, in fp32, when the
chunk enters the pool; its pages are never written again), so that a request may attend to them
in place at any position with RoPE applied in the kernel (:meth:`ChunkStore.request`,
zero-copy) and a copy into a caller's cache rotates each key once, to its target position. Chunk
files and :meth:`ChunkStore.get_kv` hold keys rotated at the chunk's local positions ``0..n-1``. A chunk's key is ``sha256(model fingerprint, token ids)``. The model
fingerprint (:func:`model_fingerprint`) hashes the model's config (every value but the attention
implementation and the path it was loaded from) and a checksum of every weight and buffer (sha256
of each tensor's bytes: any changed bit, any swap of rows or channels changes it), computed in full
at store creation (about 0.36 s for SmolLM2-135M in fp32 on one CPU core, 0.18 s in bf16). A
directory written under another fingerprint (other weights, or a release whose checksum differed)
holds other keys: its chunks are computed again, and loading one of its files by path is refused.

The store follows its model (a description with ``follow``, as the HF one): every call that serves
or writes KV (``add``, ``assemble``, ``gather_into_``, ``put``, ``get_kv``/``kv``,
``has``/``lookup``/``verify``, ``key``, ``load``, ``save``, ``pooled_kv``) first checks the
fingerprint (cached, about 0.3 ms for SmolLM2; see :func:`model_fingerprint` for what the cached
check sees: every write through the tensor API, an optimiser step, ``load_state_dict``, a config
change, and on the CPU a ``.data`` write that changes a sampled word, e.g. ``p.data.mul_``). When
the weights changed, the entries of the old weights leave memory, later keys are those of the new
weights, their old keys are refused ("earlier weights") and ``has`` reports them missing; the old
files stay on disk, valid for the old weights (restoring them makes them usable again).
:meth:`ChunkStore.refresh` checksums every byte (for ``.data`` writes the cached check cannot see:
one element, CUDA memory).

Public API (for the methods, FusionRAG's offline fusion and serving-engine connectors)
---------------------------------------------------------------------------------------
* ``store.key(tokens)`` -> key of a chunk (token ids: a list or an int tensor);
  ``store.variant_key(key, variant)`` -> key of a derived entry of that chunk (``variant_keys``: of
  several).
* ``store.add(chunks)`` -> keys: stores every chunk (prefills the misses, loads disk hits).
* ``store.put(key, variant, k_layers, v_layers)`` -> derived key: stores a variant of chunk ``key``
  (e.g. FusionRAG's fused cache: the same tokens prefilled after other context, keys re-rotated
  back to the chunk's local positions ``0..n-1``), per layer ``[n, Hkv, D]``; it is keyed, saved,
  loaded, verified, evicted and assembled exactly like a chunk.
* ``store.has(key)`` / ``store.lookup(keys)``: whether a key is in memory or in the directory as a
  complete file of the current weights (header and size checked; nothing is loaded);
  ``store.verify(key)``: the same with the file read whole and checked (a bad one is removed).
* ``store.refresh()``: full fingerprint check (see above); ``store.check_model(model, where)``: for
  the methods (this store's model, followed, or one of the same fingerprint, else an error).
* ``store.get_kv(key)`` -> ``(k_layers, v_layers)``: per layer ``[n, Hkv, D]`` *copies* (the pool
  reuses the pages of evicted chunks, so a view could later show another chunk's rows);
  ``store.kv(key)`` -> the same stacked ``[L, n, Hkv, D]``; ``store.tokens(key)`` int64 ``[n]``.
* ``store.gather_into_(keys, dst_k, dst_v, dst_rows, positions, skip=0, split_heads=False)``:
  writes the chunks (in order, ``T`` rows in all, the first ``skip`` left out) into any caller
  cache (per layer viewed as ``[rows, Hkv, D]``, or per layer and head as ``[rows, 1, D]`` with
  ``split_heads``, e.g. vLLM's paged caches: :mod:`ragattn.vllm`) at ``dst_rows`` int64, keys
  re-rotated from their local positions to ``positions``: one ``ragattn.copy_kv_`` per pool
  slab the chunks live in (usually one).
* ``store.assemble(keys, ...)``: :meth:`gather_into_` into a fresh batch-1 ``PagedKV``.
* ``store.request(keys, positions, extra_slots)`` -> :class:`ZeroCopyRequest`: no copy; a
  position-tagged page table over the chunks' own (shared) pool pages plus private pool pages
  (``ragattn.kv.TaggedPagedKV``), keys rotated in the attention kernel, pages a recompute
  writes copied on write; the chunks stay pinned until ``req.release()`` (docs/chunk-store.md).

Memory: a byte budget, LRU eviction, no 2x growth
--------------------------------------------------
The in-memory pool holds at most ``memory_budget`` bytes of K/V (default: a quarter of the
memory available on the model's device when the store is created; see :func:`default_budget`).
It is made of *slabs* (per layer ``[rows, Hkv, D]`` K and V tensors) cut into pages of
``page_size`` rows; a chunk is a list of pages, of one slab when one has room, else spread over
several (so pinned chunks that fragment the slabs never make a request that fits fail). The pool
grows by adding a slab (never by copying into a larger one: no transient 2x peak), and when the
budget is reached it evicts the least recently used chunks (``add`` hits and ``assemble`` count as
uses) and reuses their pages.
An evicted chunk reloads bit-exact from the directory when it was saved there; a chunk computed
without a (writable) directory, or whose file went missing or bad, is recomputed from its tokens
(kept in host memory for every evicted chunk, 8 bytes a token) on its next use; a derived entry
that exists only in memory is dropped (``has`` turns False; build it again). ``pool_bytes`` is
the pool's allocated size (never above the budget), ``num_rows`` the tokens held. On the CPU the
first slab is larger (up to 1 GiB or two model windows, within a quarter of the budget): its pages
take memory only when written, and a long request then reads one slab (one attention call per
layer).

Zero-copy requests (:meth:`ChunkStore.request`) read the pool in place: their chunks are pinned
(the LRU evicts only chunks no live request holds) and their private pages come from the same
budget (shared chunk pages counted once), until released.

Assembled requests use *copy-out* semantics: :meth:`assemble` / :meth:`gather_into_` copy the
chunks' rows into the request's own cache, so an ``AssembledRequest`` never refers to pool
memory and later evictions cannot change it. During one call every chunk it gathers is pinned,
so loading or recomputing one of them never evicts another; a request is refused
(``ChunkStoreError``) exactly when its distinct chunks need more pages than the budget holds. A
store object is not thread-safe (one per thread); several stores and methods may use one model
from several threads (the attention switch is shared: :mod:`ragattn.hf.attn_switch`).

:meth:`ChunkStore.pooled_kv` copies the whole pool out (e.g. to pinned host memory) and
:meth:`ChunkStore.load_pooled_kv_` copies it back, for keeping chunk KV off the GPU; a copy taken
before chunks were added, evicted or overwritten is refused.

On disk: one ``<key>.safetensors`` per chunk (``k``, ``v`` ``[L, n, Hkv, D]``, ``tokens`` int64
``[n]``) with metadata (format, model fingerprint, key, sha256 of the tensor bytes) in the
model's dtype (``put`` refuses another). A file is written (temporary file, fsync, rename,
directory fsync) before its chunk enters the pool, and fully read and verified before anything is
inserted: nothing of a truncated, corrupt or foreign (other fingerprint) file is ever loaded. An
explicit :meth:`ChunkStore.load` of such a file raises ``ChunkStoreError``; inside ``add`` and
the reloads of evicted chunks a truncated or corrupt file is recomputed and replaced (a corrupt
derived entry, which cannot be recomputed, is removed and reported). Temporary files of writers
that died are removed when a writable store opens the directory (module
:mod:`ragattn.store.disk_tier`). A directory that cannot be written is refused at
creation, naming it, unless ``read_only=True`` (serve the chunks in it; new chunks stay in memory).

The class is assembled from one module per concern: :mod:`.entries` (pool entries, LRU, pins),
:mod:`.chunk_files` (disk I/O), :mod:`.add` (prefill of missing chunks, derived entries),
:mod:`.export` (chunk copies at local positions, the pool copied out), :mod:`.copy_out` (gather and assemble),
:mod:`.zero_copy` (requests over the pool's own pages); this module holds the model following and
the lookups.
"""
from __future__ import annotations

import numbers
import os
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import torch

from ragattn.store.add import _Add
from ragattn.store.chunk_files import _ChunkFiles
from ragattn.store.copy_out import _CopyOut
from ragattn.store.disk_tier import DiskTier
from ragattn.store.entries import _Entries, _Entry
from ragattn.store.errors import ChunkStoreError
from ragattn.store.export import _Export
from ragattn.store.fingerprint import chunk_key, model_fingerprint, variant_key
from ragattn.store.model import ChunkModel, describe_model
from ragattn.store.page_pool import PagePool, default_budget
from ragattn.store.remote_tier import RemoteTier
from ragattn.store.zero_copy import _ZeroCopy


class ChunkStore(_Entries, _ChunkFiles, _Add, _Export, _CopyOut, _ZeroCopy):
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
    ``RAGATTN_REMOTE_SECRET`` environment variable); ``remote_options``: keyword arguments of
    :class:`RemoteTier` (``timeout``, ``max_value_bytes``, ``prefix``, ``client_options``)."""

    def __init__(self, model, directory: str | os.PathLike | None = None, page_size: int = 16,
                 max_batch_tokens: int = 8192, *, memory_budget: int | None = None,
                 read_only: bool = False, fingerprint: str | None = None, device=None,
                 remote=None, remote_secret=None, remote_options: dict | None = None):
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
        self._layout_dims = (self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)
        self._disk = None if directory is None else DiskTier(directory, self.read_only, self._layout_dims)
        budget = default_budget(self.device) if memory_budget is None else int(memory_budget)
        self._pool = PagePool(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.device,
                              page_size, budget, self.max_positions)
        self.row_bytes = self._pool.row_bytes
        self.memory_budget = budget
        self._entries: "OrderedDict[str, _Entry]" = OrderedDict()   # LRU order: oldest first
        # evicted chunks (not derived entries): tokens, to recompute one whose file is missing or bad
        self._recomputable: dict[str, torch.Tensor] = {}
        self._live_requests: dict[int, tuple[list, list]] = {}   # zero-copy: (pinned entries, private parts)
        self._layout = 0     # bumped whenever pool rows change meaning (insert, evict, overwrite)
        self._pooled_layout = None
        self._inv_freq = self.rope.inv_freq.to(self.device)
        self._spare: list[torch.Tensor] = []   # at most one request-cache buffer (_request_cache)
        self._stale: set[str] = set()   # keys dropped because the model's weights changed
        self._bad_files: set[str] = set()   # keys of bad files that could not be removed (read-only)
        # counters: chunks computed, recomputed after eviction, loaded from disk; entries evicted;
        # weight changes followed; bad files (truncated, corrupt) replaced or dropped
        self.stats = {"computed": 0, "recomputed": 0, "loaded": 0, "evicted": 0, "weight_changes": 0,
                      "bad_files": 0}
        self._remote = None
        if remote is not None:
            if not isinstance(remote, RemoteTier):
                secret = remote_secret if remote_secret is not None else os.environ.get("RAGATTN_REMOTE_SECRET")
                remote = RemoteTier(str(remote), secret, **(remote_options or {}))
            self._remote = remote
            self.stats.update(remote.stats)     # one counter dict: remote_hits, _published, _bad, _errors
            remote.stats = self.stats

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
        if any(e.pins for e in self._entries.values()):
            raise ChunkStoreError("ragattn.ChunkStore: the model's weights changed during a gather or while "
                                  "a live zero-copy request holds chunks of the store (release it first)")
        self._stale.update(self._entries)
        self._stale.update(self._recomputable)
        for key in list(self._entries):
            e = self._entries.pop(key)
            self._pool.free(e.parts)
        self._recomputable.clear()
        self._layout += 1
        self.description = spec
        self.fingerprint = spec.fingerprint
        self.rope = spec.rope           # inv_freq is a buffer: it may have changed too
        self._inv_freq = self.rope.inv_freq.to(self.device)
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
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

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
        if isinstance(keys, str):
            raise ChunkStoreError("ragattn.ChunkStore.variant_keys: keys must be a sequence of keys, got one key "
                                  "(a str); use variant_key for one")
        self._sync()
        return [variant_key(self.fingerprint, k, variant) for k in keys]

    def has(self, key: str) -> bool:
        """Whether ``key`` is in memory, or on disk in the store's directory as a complete file of
        the model's current weights (its header and size are checked; nothing is loaded)."""
        self._sync()
        return self._has(key)

    def _has(self, key: str) -> bool:
        return key in self._entries or self._on_disk(key)

    def lookup(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`has` of each key."""
        self._sync()
        return [self._has(k) for k in keys]

    def tokens(self, key: str) -> torch.Tensor:
        self._sync()
        return self._tokens_of(key)
