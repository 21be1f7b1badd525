"""The chunk KV store: precomputed per-chunk KV caches, in a bounded memory pool and on disk.

    from ragattn.methods import ChunkStore
    store = ChunkStore(model, directory="kv/")          # directory optional (memory only)
    keys = store.add([tok_ids_a, tok_ids_b, ...])       # one batched independent prefill of the misses
    req = store.assemble(keys, positions="reordered", extra_slots=64)
    # req.cache: ragattn.hf.attention.PagedKV holding the chunks' K/V at their request slots,
    # keys re-rotated to their request positions; req.next_position: RoPE position after the chunks.

Chunk K/V are computed by one ``varlen_attention`` forward over all missing chunks packed (one
sequence per chunk, positions 0..n-1 per chunk); the pool keeps each chunk's keys *position-free*
(un-rotated once, in fp32, when the chunk enters the pool; its pages are never written again), so
that a request may attend to them in place with RoPE applied in the kernel (:meth:`ChunkStore.request`,
zero-copy) and a copy into a caller's cache rotates each key once, to its target position. Chunk
files and :meth:`ChunkStore.get_kv` hold keys rotated at the chunk's local positions ``0..n-1``. A chunk's key is ``sha256(model fingerprint, token ids)``. The model
fingerprint (:func:`model_fingerprint`) hashes the model's config (every value but the attention
implementation and the path it was loaded from) and a checksum of every weight and buffer (two
exact int64 sums over each tensor's bytes: any changed bit changes it), computed in full at store
creation (about 0.1 s for SmolLM2-135M on one CPU core).

The store follows its model: every call that serves or writes KV (``add``, ``assemble``,
``gather_into_``, ``put``, ``get_kv``/``kv``, ``has``/``lookup``/``verify``, ``key``, ``load``,
``save``, ``pooled_kv``) first checks the fingerprint (cached, about 0.3 ms for SmolLM2; see
:func:`model_fingerprint` for what the cached check sees: every write through the tensor API, an
optimiser step, ``load_state_dict``, a config change, and on the CPU a ``.data`` write that changes
a sampled word, e.g. ``p.data.mul_``). When the weights changed, the entries of the old weights
leave memory, later keys are those of the new weights, their old keys are refused ("earlier
weights") and ``has`` reports them missing; the old files stay on disk, valid for the old weights
(restoring them makes them usable again). :meth:`ChunkStore.refresh` checksums every byte (for
``.data`` writes the cached check cannot see: one element, CUDA memory).

Public API (for the methods, FusionRAG's offline fusion and serving-engine connectors)
---------------------------------------------------------------------------------------
* ``store.key(tokens)`` -> key of a chunk (token ids: a list or an int tensor);
  ``store.variant_key(key, variant)`` -> key of a derived entry of that chunk.
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
  (``ragattn.hf.tagged.TaggedPagedKV``), keys rotated in the attention kernel, pages a recompute
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
without a (writable) directory is recomputed from its tokens (kept in host memory, 8 bytes a
token) on its next use; a derived entry
that exists only in memory is dropped (``has`` turns False; build it again). ``pool_bytes`` is
the pool's allocated size (never above the budget), ``num_rows`` the tokens held.

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
:mod:`ragattn.methods.store.disk_tier`). A directory that cannot be written is refused at
creation, naming it, unless ``read_only=True`` (serve the chunks in it; new chunks stay in memory).
"""
from __future__ import annotations

import hashlib
import itertools
import os
import re
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ragattn.hf.attention import PagedKV, use_ragattn
from ragattn.hf.rope import RopeParams, rope_params
from ragattn import ops as _ops
from ragattn.methods.store.disk_tier import DiskTier, read_chunk_file, write_chunk_file
from ragattn.methods.store.errors import ChunkStoreError
from ragattn.methods.store.fingerprint import chunk_key, model_fingerprint, variant_key
from ragattn.methods.store.page_pool import PagePool, _Slab, default_budget


_KEY = re.compile(r"^[0-9a-f]{40}$")
_MAX_POSITION = (1 << 31) - 1   # rotation deltas are int32


def _check_chunks_and_extra(method: str, keys, extra_slots) -> None:
    """The arguments ``ChunkStore.request`` and ``ChunkStore.assemble`` share: at least one chunk,
    and ``extra_slots`` an int >= 0."""
    if len(keys) == 0:
        raise ChunkStoreError(f"ragattn.ChunkStore.{method}: no chunks given (empty retrieval)")
    if isinstance(extra_slots, bool) or not isinstance(extra_slots, int) or extra_slots < 0:
        raise ChunkStoreError(f"ragattn.ChunkStore.{method}: extra_slots must be an integer >= 0, "
                              f"got {extra_slots!r}")


def _chunk_starts(lens: Sequence[int]) -> list[int]:
    """Each chunk's first logical slot: chunk after chunk."""
    return [0, *itertools.accumulate(lens[:-1])]


def _storage_refs(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_LONE_REFS = _storage_refs(torch.empty(1))   # a tensor whose storage nothing else shares


def _sole_owner(t: torch.Tensor) -> bool:
    """Whether no other tensor (a view kept by a caller) shares ``t``'s memory."""
    return _storage_refs(t) == _LONE_REFS


def _keep_spare(spare: list, buf: torch.Tensor) -> None:
    """Finalizer of an assembled request cache: its buffer becomes the store's one spare."""
    spare.clear()
    spare.append(buf)


@dataclass(eq=False)
class _Entry:
    tokens: torch.Tensor          # int64 [n], CPU
    parts: list[tuple[_Slab, list[int], int]]   # (slab, pages, rows) in token order; usually one
    rows: torch.Tensor            # int64 [n]: each token's row in its part's slab, on the store's device
    on_disk: bool                 # a verified file of it is in the store's directory
    variant: tuple[str, str] | None = None   # (chunk key, variant name) of a derived entry
    pins: int = field(default=0)

    @property
    def length(self) -> int:
        return int(self.tokens.numel())


def _release_request(pool: PagePool, pinned: list, private: list, cache_ref) -> None:
    """Finalizer of a zero-copy request: its private pages go back to the pool, its chunks are
    unpinned, its cache (when still alive) refuses any later use."""
    cache = cache_ref()
    if cache is not None:
        cache.close()
    PagePool.free(private)
    private.clear()
    for e in pinned:
        e.pins -= 1
    pinned.clear()


class ZeroCopyRequest:
    """A request over the store's own pages (:meth:`ChunkStore.request`): ``cache`` is a
    :class:`~ragattn.hf.tagged.TaggedPagedKV` whose page table lists the chunks' shared pool pages
    (with their positions) and the request's private pages. ``chunk_starts``/``chunk_lens``,
    ``positions`` (int32 ``[num_slots]``, each chunk slot's RoPE position), ``next_position``
    and ``num_slots`` mean what they mean on :class:`AssembledRequest`.

    The chunks stay pinned (never evicted) and the private pages allocated until :meth:`release`
    (or the end of a ``with`` block, or when the request and its cache are garbage-collected);
    afterwards the cache refuses every use. ``private_pages``/``private_bytes``: what this
    request holds on its own (question/answer pages and pages copied on write), the shared
    chunk pages being counted once, in the store's ``pool_bytes``."""

    def __init__(self, cache, chunk_starts, chunk_lens, positions, next_position, release, page_bytes):
        self.cache = cache
        self.chunk_starts, self.chunk_lens = chunk_starts, chunk_lens
        self.positions, self.next_position = positions, next_position
        self.num_slots = sum(chunk_lens)
        self._release, self._page_bytes = release, page_bytes

    @property
    def private_pages(self) -> int:
        return self.cache.private_pages

    @property
    def private_bytes(self) -> int:
        return self.private_pages * self._page_bytes

    @property
    def released(self) -> bool:
        return not self._release.alive

    def release(self) -> None:
        """Give the private pages back and unpin the chunks (idempotent)."""
        self._release()

    def __enter__(self) -> "ZeroCopyRequest":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass
class AssembledRequest:
    """A request cache filled with chunks. ``cache`` holds ``num_slots`` slots (row 0 of a batch-1
    ``PagedKV``); ``chunk_starts[i]``/``chunk_lens[i]`` are chunk i's slots, ``positions`` int32
    ``[num_slots]`` the RoPE position of each slot, ``next_position`` where the final block starts.
    The cache is the request's own copy (see the module docstring: copy-out semantics)."""
    cache: PagedKV
    chunk_starts: list[int]
    chunk_lens: list[int]
    positions: torch.Tensor
    next_position: int

    @property
    def num_slots(self) -> int:
        return int(self.cache.lengths[0])


class ChunkStore:
    """Precomputed chunk KV caches for one model (see the module docstring).

    ``directory``: the disk tier (created if missing; must be writable unless ``read_only``).
    ``page_size``: rows per page of the pool and of assembled request caches.
    ``max_batch_tokens``: tokens per packed prefill of missing chunks.
    ``memory_budget``: bytes of K/V the in-memory pool may hold (default :func:`default_budget`).
    ``read_only``: never write to ``directory`` (chunks computed here stay in memory only)."""

    def __init__(self, model, directory: str | os.PathLike | None = None, page_size: int = 16,
                 max_batch_tokens: int = 8192, *, memory_budget: int | None = None,
                 read_only: bool = False, fingerprint: str | None = None, device=None):
        if page_size < 1 or max_batch_tokens < 1:
            raise ChunkStoreError(f"ragattn.ChunkStore: page_size and max_batch_tokens must be >= 1, "
                                  f"got {page_size} and {max_batch_tokens}")
        self.model = model
        self.config = model.config
        self.rope: RopeParams = rope_params(model)
        # fingerprint=/device=: computed elsewhere, for a model whose parameters are not materialised
        # (the vLLM worker: ragattn.vllm.fingerprint); such a store serves chunk files only and does
        # not follow the (empty) model's weights
        self._fixed_fingerprint = fingerprint is not None
        self.fingerprint = model_fingerprint(model, cached=False) if fingerprint is None else fingerprint
        self.num_layers = self.config.num_hidden_layers
        self.num_kv_heads = self.config.num_key_value_heads
        self.head_dim = self.rope.head_dim
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device if device is None else torch.device(device)
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
        self._recomputable: dict[str, torch.Tensor] = {}            # evicted, not on disk: tokens
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

    # ----- the model's weights ------------------------------------------------------------
    def _sync(self) -> None:
        """Follow the model: when its fingerprint changed since the last call (weights edited in
        place, a config change; see :func:`model_fingerprint` for what the cached check sees),
        every entry computed with the old weights leaves memory and later keys use the new one."""
        if self._fixed_fingerprint:
            return
        fp = model_fingerprint(self.model)
        if fp != self.fingerprint:
            self._weights_changed(fp)

    def refresh(self) -> str:
        """Checksum every weight byte (``model_fingerprint(cached=False)``: also sees ``.data``
        writes the per-call check cannot, e.g. to one element or to CUDA memory) and follow the
        model if it changed; returns the fingerprint."""
        if self._fixed_fingerprint:
            return self.fingerprint
        fp = model_fingerprint(self.model, cached=False)
        if fp != self.fingerprint:
            self._weights_changed(fp)
        return fp

    def _weights_changed(self, fp: str) -> None:
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
        self.fingerprint = fp
        self.rope = rope_params(self.model)           # inv_freq is a buffer: it may have changed too
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

    # ----- pool ---------------------------------------------------------------------------
    @property
    def pool_bytes(self) -> int:
        """Bytes of K/V the pool has allocated (all slabs); never above ``memory_budget``."""
        return self._pool.pool_bytes

    @property
    def num_rows(self) -> int:
        """Tokens of every chunk in memory."""
        return sum(e.length for e in self._entries.values())

    @property
    def pool_rows(self) -> int:
        """Rows the pool has allocated (``pool_bytes / row_bytes``), the rows of :meth:`pooled_kv`."""
        return self._pool.pool_rows

    def _evict_one(self) -> bool:
        for key, e in self._entries.items():
            if e.pins == 0:
                self._evict(key)
                return True
        return False

    def _evict(self, key: str) -> None:
        e = self._entries.pop(key)
        self._pool.free(e.parts)
        self.stats["evicted"] += 1
        if not e.on_disk and e.variant is None:
            self._recomputable[key] = e.tokens
        self._layout += 1

    def _insert(self, key, tokens, k_layers, v_layers, on_disk: bool, variant=None) -> _Entry:
        """Copy per-layer ``[n, Hkv, D]`` K/V (any device/dtype-compatible) into fresh pages."""
        n = int(tokens.numel())
        parts = self._pool.alloc(n, self._evict_one)
        rows = self._pool.rows_of(parts)
        self._pool.write(parts, rows, k_layers, v_layers)
        self._rotate_parts_(parts, rows, -1)   # position-free: un-rotated from 0..n-1, in fp32
        e = _Entry(tokens.to("cpu", torch.int64), parts, rows, on_disk, variant)
        self._entries[key] = e
        self._recomputable.pop(key, None)
        self._layout += 1
        return e

    def _rotate_parts_(self, parts, rows: torch.Tensor, sign: int) -> None:
        """Rotate the keys of a chunk (``parts``/``rows`` of its pages, token order) in place by
        ``sign * j`` for its token ``j``: -1 makes keys computed at ``0..n-1`` position-free
        (the pool's form), +1 the reverse. One ``rerotate_keys_`` per slab (fp32 rotation)."""
        at = 0
        for slab, _, r in parts:
            delta = torch.arange(at, at + r, dtype=torch.int64, device=self.device)
            _ops.rerotate_keys_(slab.k, rows[at: at + r], delta if sign > 0 else delta.neg_(), self._inv_freq,
                                self.rope.rotary_dim, self.rope.interleaved)
            at += r

    def _read_local(self, e: "_Entry") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer ``[n, Hkv, D]`` copies of an entry, keys rotated to its local positions
        ``0..n-1`` (the form of chunk files and of :meth:`get_kv`)."""
        k, v = self._pool.read(e.parts, e.rows)
        n = e.length
        if n:
            _ops.rerotate_keys_(k, torch.arange(n, device=self.device), torch.arange(n, device=self.device),
                                self._inv_freq, self.rope.rotary_dim, self.rope.interleaved)
        return k, v

    def pooled_kv(self, device: str | torch.device = "cpu", pin_memory: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the whole in-memory pool, e.g. to keep the chunk KV in host memory.

        Returns K, V: ``[L, pool_rows, Hkv, D]`` each (every allocated pool row, the slabs in
        order; rows of free pages hold garbage), in the model's dtype, on ``device``;
        ``pin_memory=True`` (CPU ``device`` only, needs CUDA) allocates them in page-locked
        memory so that :meth:`load_pooled_kv_` can copy them to the GPU asynchronously. The copy
        is only meaningful to this store while no chunk is added, evicted or overwritten.
        Keys are position-free (no RoPE; :meth:`get_kv` rotates them to their local positions)."""
        self._sync()
        device = torch.device(device)
        if pin_memory and device.type != "cpu":
            raise ChunkStoreError(f"ragattn.ChunkStore.pooled_kv: pin_memory needs device 'cpu', "
                                  f"got {device}")
        if pin_memory and not torch.cuda.is_available():
            raise ChunkStoreError("ragattn.ChunkStore.pooled_kv: pin_memory=True needs CUDA (page-locked "
                                  "host memory is for asynchronous copies to a GPU); none is available")
        out = self._pool.copy_out(device, pin_memory)
        self._pooled_layout = self._layout
        return out

    def load_pooled_kv_(self, k: torch.Tensor, v: torch.Tensor, non_blocking: bool = False) -> None:
        """Overwrite the in-memory pool with ``k``, ``v`` from :meth:`pooled_kv` (any device).

        ``k``, ``v``: ``[L, pool_rows, Hkv, D]`` in the store's dtype, copied from this store
        since its last change: after a chunk was added, evicted or overwritten the copy is stale
        (``ChunkStoreError``). ``non_blocking=True`` with pinned host tensors makes the
        host-to-device copies asynchronous (ordered on the current stream before later kernels)."""
        self._sync()
        want = (self.num_layers, self.pool_rows, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise ChunkStoreError(f"ragattn.ChunkStore.load_pooled_kv_: {name} must be a tensor, "
                                      f"got {type(t).__name__}")
            if tuple(t.shape) != want:
                raise ChunkStoreError(f"ragattn.ChunkStore.load_pooled_kv_: {name} has shape "
                                      f"{tuple(t.shape)}, expected {want} ([L, pool_rows, Hkv, D])")
            if t.dtype != self.dtype:
                raise ChunkStoreError(f"ragattn.ChunkStore.load_pooled_kv_: {name} has dtype {t.dtype}, "
                                      f"expected {self.dtype}")
        if any(e.pins for e in self._entries.values()):
            # a live zero-copy request's private pages (its question and answer) are pool pages too
            raise ChunkStoreError("ragattn.ChunkStore.load_pooled_kv_: live requests hold pages of the pool "
                                  "(release them first): the copy would overwrite their private pages")
        if self._pooled_layout != self._layout:
            raise ChunkStoreError("ragattn.ChunkStore.load_pooled_kv_: the pool changed (chunks added, "
                                  "evicted or overwritten) since pooled_kv() was taken: the copy is stale")
        self._pool.copy_in(k, v, non_blocking)

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

    def has(self, key: str) -> bool:
        """Whether ``key`` is in memory, or on disk in the store's directory as a complete file of
        the model's current weights (its header and size are checked; nothing is loaded)."""
        self._sync()
        return self._has(key)

    def _has(self, key: str) -> bool:
        return key in self._entries or self._on_disk(key)

    def _on_disk(self, key: str) -> bool:
        """A complete file of ``key`` for the current weights is in the directory (header and
        size checked: a truncated file, or another model's, is not; it is replaced when the
        chunk is computed again, never deleted)."""
        return self._disk is not None and key not in self._bad_files and self._disk.has(key, self.fingerprint)

    def _bad_file(self, key: str) -> None:
        """The file of ``key``, complete and of this model by its header, failed its checks (a
        corrupt file): remove it (a read-only directory: remember it), so that it is recomputed,
        or reported missing, from now on."""
        self.stats["bad_files"] += 1
        if not self._disk.remove(key):
            self._bad_files.add(key)

    def verify(self, key: str) -> bool:
        """Like :meth:`has`, but a file is read whole and checked (checksum included) first; a bad
        one is removed (``has`` turns False). For resuming an offline build: what exists is
        checked, not trusted. Nothing is loaded into the pool."""
        self._sync()
        if key in self._entries:
            return True
        if not self._on_disk(key):
            return False
        try:
            read_chunk_file(self._path(key), self.fingerprint, self._layout_dims)
        except ChunkStoreError:
            self._bad_file(key)
            return False
        return True

    def lookup(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`has` of each key."""
        self._sync()
        return [self._has(k) for k in keys]

    def put(self, key: str, variant: str, k_layers: Sequence[torch.Tensor],
            v_layers: Sequence[torch.Tensor]) -> str:
        """Store a derived entry of the chunk ``key`` (which must be in the store); returns its key.

        ``k_layers``, ``v_layers``: per layer ``[n, Hkv, D]`` (``n`` = the chunk's tokens), keys
        rotated at the chunk's local positions ``0..n-1``. Written to the directory, if any,
        before it enters the pool; an existing entry of that variant is replaced."""
        self._sync()
        tokens = self._tokens_of(key)
        want = (tokens.numel(), self.num_kv_heads, self.head_dim)
        if len(k_layers) != self.num_layers or len(v_layers) != self.num_layers or any(
                tuple(t.shape) != want for t in [*k_layers, *v_layers]):
            raise ChunkStoreError(f"ragattn.ChunkStore.put: expected {self.num_layers} layers of K and "
                                  f"V of shape {want} ([n, Hkv, D])")
        bad = {str(t.dtype) for t in [*k_layers, *v_layers] if t.dtype != self.dtype}
        if bad:   # a file in another dtype could never be loaded again
            raise ChunkStoreError(f"ragattn.ChunkStore.put: K/V must have the model's dtype {self.dtype}, "
                                  f"got {', '.join(sorted(bad))}")
        vkey = self.variant_key(key, variant)
        on_disk = False
        if self._writable:
            self._write_file(vkey, tokens, torch.stack(list(k_layers)), torch.stack(list(v_layers)),
                             (key, variant))
            on_disk = True
        if vkey in self._entries:
            if self._entries[vkey].pins:
                raise ChunkStoreError("ragattn.ChunkStore.put: the entry is in use by a running gather")
            self._evict(vkey)
        self._insert(vkey, tokens, k_layers, v_layers, on_disk, (key, variant))
        return vkey

    def get_kv(self, key: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K, V of a stored chunk: per layer ``[n, Hkv, D]`` copies, keys rotated to the chunk's
        local positions ``0..n-1`` (the pool holds them position-free: rotated here, in fp32)."""
        self._sync()
        e = self._get(key)
        return self._read_local(e)

    def kv(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of a stored chunk: ``[L, n, Hkv, D]`` each (copies; keys at local positions)."""
        k, v = self.get_kv(key)
        return torch.stack(k), torch.stack(v)

    def tokens(self, key: str) -> torch.Tensor:
        self._sync()
        return self._tokens_of(key)

    def _tokens_of(self, key: str) -> torch.Tensor:
        e = self._entries.get(key)
        if e is not None:
            return e.tokens
        if key in self._recomputable:
            return self._recomputable[key]
        return self._get(key).tokens

    def _get(self, key: str) -> _Entry:
        """The entry of ``key``, loaded or recomputed into the pool if needed (marked used)."""
        e = self._entries.get(key)
        if e is None:
            if self._on_disk(key):
                try:
                    self._load(self._path(key))
                except ChunkStoreError as exc:
                    self._bad_file(key)
                    if key not in self._recomputable:
                        raise ChunkStoreError(f"{exc} (removed from the store: it cannot be recomputed "
                                              "here, build it again)") from None
            if key not in self._entries and key in self._recomputable:
                self._prefill([(key, self._recomputable[key])])
            e = self._entries.get(key)
            if e is None:
                if key in self._stale:
                    raise ChunkStoreError(
                        f"ragattn.ChunkStore: chunk {key!r} was computed with the model's earlier weights "
                        "(they changed since): add() its tokens again for its key under the current weights")
                raise ChunkStoreError(f"ragattn.ChunkStore: no chunk with key {key!r} in the store")
        else:
            self._entries.move_to_end(key)
        return e

    # ----- compute --------------------------------------------------------------------------
    @property
    def _writable(self) -> bool:
        return self._disk is not None and self._disk.writable

    def _check_tokens(self, chunks) -> list[np.ndarray]:
        """Each chunk as a 1-D int64 array (numpy: no torch dispatch per chunk on the hot path)."""
        toks = []
        for c in chunks:
            a = c.detach().cpu().numpy() if isinstance(c, torch.Tensor) else np.asarray(c)
            if a.ndim != 1:
                raise ChunkStoreError(f"ragattn.ChunkStore.add: a chunk must be a 1-D sequence of token ids, "
                                      f"got shape {tuple(a.shape)}")
            if a.size == 0:
                raise ChunkStoreError("ragattn.ChunkStore.add: a chunk has no tokens")
            if a.dtype.kind not in "iu":
                raise ChunkStoreError(f"ragattn.ChunkStore.add: token ids must be integers, got {a.dtype}")
            if a.size > self.max_positions:
                raise ChunkStoreError(
                    f"ragattn.ChunkStore.add: chunk of {a.size} tokens is longer than the model's "
                    f"window (max_position_embeddings={self.max_positions})")
            toks.append(np.ascontiguousarray(a.reshape(-1), dtype=np.int64))
        if toks:
            flat = np.concatenate(toks) if len(toks) > 1 else toks[0]
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ChunkStoreError(f"ragattn.ChunkStore.add: token id {lo if lo < 0 else hi} is outside "
                                      f"the model's vocabulary [0, {self.vocab_size})")
        return toks

    @torch.no_grad()
    def add(self, chunks: Sequence[Sequence[int]]) -> list[str]:
        """Store the KV of every chunk (token id lists or int tensors); returns their keys in order.

        Chunks already in memory or on disk are not recomputed (disk hits are loaded); the rest
        are prefilled together (packed, one independent sequence per chunk) in batches of
        ``max_batch_tokens`` tokens, each written to the directory before it enters the pool.
        On an error no chunk is left half-added (each is in memory and on disk, or absent).
        Adding more than the budget holds evicts the least recently used chunks (also from this
        call)."""
        self._sync()
        toks = self._check_tokens(chunks)
        fp = self.fingerprint.encode()
        keys = [hashlib.sha256(fp + t.tobytes()).hexdigest()[:40] for t in toks]   # == chunk_key
        missing, seen = [], set()
        for k, t in zip(keys, toks):
            if k in self._entries:
                self._entries.move_to_end(k)
                continue
            if k in seen:
                continue
            if self._on_disk(k):
                try:
                    self._load(self._path(k))
                    continue
                except ChunkStoreError:   # truncated or corrupt: recomputed below, the file replaced
                    self._bad_file(k)
            seen.add(k)
            missing.append((k, torch.from_numpy(t)))
        self._prefill(missing)
        return keys

    def _prefill(self, items, pinned: list | None = None):
        """Prefill ``(key, tokens)`` items in packed batches; with ``pinned``, pin each new entry
        (appended to it) as soon as it is in the pool."""
        batch, n = [], 0
        for item in items:
            if batch and n + item[1].numel() > self.max_batch_tokens:
                self._prefill_batch(batch, pinned)
                batch, n = [], 0
            batch.append(item)
            n += item[1].numel()
        if batch:
            self._prefill_batch(batch, pinned)

    def _prefill_batch(self, batch, pinned):
        lens = [t.numel() for _, t in batch]
        ids = torch.cat([t for _, t in batch])[None].to(self.device)
        pos = torch.cat([torch.arange(n) for n in lens])[None].to(self.device)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lens).cumsum(0)
        capture: list = []
        base = getattr(self.model, "model", self.model)
        with use_ragattn(self.model):
            base(input_ids=ids, position_ids=pos, use_cache=False, ragattn_cu_seqlens=cu.to(self.device),
                 ragattn_capture=capture)
        if len(capture) != self.num_layers:
            raise RuntimeError(f"ragattn.ChunkStore: captured {len(capture)} layers, expected {self.num_layers}")
        ks = [k[0].transpose(0, 1) for k, _ in capture]     # [T, Hkv, D]
        vs = [v[0].transpose(0, 1) for _, v in capture]
        for (key, t), a, b in zip(batch, cu[:-1].tolist(), cu[1:].tolist()):
            k_layers, v_layers = [k[a:b] for k in ks], [v[a:b] for v in vs]
            if self._writable:  # on disk first: a failed write leaves nothing half-added
                self._write_file(key, t, torch.stack(k_layers), torch.stack(v_layers))
                self._bad_files.discard(key)
            self.stats["recomputed" if key in self._recomputable else "computed"] += 1
            e = self._insert(key, t, k_layers, v_layers, on_disk=self._writable)
            if pinned is not None:
                e.pins += 1
                pinned.append(e)

    # ----- disk -----------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self._disk.path(key)

    def _write_file(self, key, tokens, k, v, variant=None, directory: Path | None = None) -> Path:
        """Write ``k``, ``v`` ``[L, n, Hkv, D]`` and ``tokens`` to ``<directory>/<key>.safetensors``
        atomically (the store's directory by default)."""
        return write_chunk_file(self.directory if directory is None else directory, key, tokens, k, v,
                                self.fingerprint, variant)

    def save(self, key: str, directory: str | os.PathLike | None = None) -> Path:
        """Write a chunk to ``<directory>/<key>.safetensors`` atomically; returns the path."""
        self._sync()
        d = Path(directory) if directory is not None else self.directory
        if d is None:
            raise ChunkStoreError("ragattn.ChunkStore.save: the store has no directory")
        if directory is None and self.read_only:
            raise ChunkStoreError(f"ragattn.ChunkStore.save: the store's directory {d} is read-only")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ChunkStoreError(f"ragattn.ChunkStore.save: cannot create directory {d} "
                                  f"({exc.strerror or exc})") from None
        e = self._get(key)
        k, v = (torch.stack(x) for x in self._read_local(e))
        path = self._write_file(key, e.tokens, k, v, e.variant, d)
        if directory is None:
            e.on_disk = True
        return path

    def load(self, key_or_path: str | os.PathLike) -> str:
        """Load and verify one chunk file (by key in the store's directory, or by path); returns its key."""
        self._sync()
        p = Path(key_or_path)
        if not p.suffix == ".safetensors":
            text = str(key_or_path)
            if not _KEY.match(text):
                raise ChunkStoreError(f"ragattn.ChunkStore.load: {text!r} is neither a chunk key (40 hex "
                                      "digits) nor a chunk file (<key>.safetensors)")
            if self.directory is None:
                raise ChunkStoreError(f"ragattn.ChunkStore.load: key {text!r}: a bare key needs a store "
                                      "directory (this store has none)")
            p = self._path(text)
        return self._load(p)

    def _load(self, p: Path) -> str:
        key, tokens, k, v, variant = read_chunk_file(p, self.fingerprint, self._layout_dims)
        if key in self._entries:
            self._entries.move_to_end(key)
        else:
            on_disk = self._disk is not None and p.resolve() == self._path(key).resolve()
            self.stats["loaded"] += 1
            self._insert(key, tokens, k, v, on_disk, variant)
        return key

    # ----- assembly -------------------------------------------------------------------------
    def _pin(self, keys: Sequence[str]) -> tuple[list[_Entry], list[_Entry]]:
        """``(entries of keys in order, pinned)``: every entry in the pool and pinned, the resident
        ones first, so that loading or recomputing the others never evicts one of them. Release
        with :meth:`_unpin` (``pinned``: each distinct entry once)."""
        pinned: list[_Entry] = []
        try:
            unique = list(dict.fromkeys(keys))
            for k in unique:
                e = self._entries.get(k)
                if e is not None:
                    e.pins += 1
                    pinned.append(e)
            recompute = []
            for k in unique:
                if k in self._entries:
                    continue
                if k in self._recomputable and not self._on_disk(k):
                    recompute.append((k, self._recomputable[k]))
                    continue
                e = self._get(k)
                e.pins += 1
                pinned.append(e)
            self._prefill(recompute, pinned)
            out = []
            for k in keys:
                self._entries.move_to_end(k)
                out.append(self._entries[k])
            return out, pinned
        except BaseException:
            self._unpin(pinned)
            raise

    @staticmethod
    def _unpin(pinned):
        for e in pinned:
            e.pins -= 1

    @torch.no_grad()
    def gather_into_(self, keys: Sequence[str], dst_k: Sequence[torch.Tensor], dst_v: Sequence[torch.Tensor],
                     dst_rows: torch.Tensor, positions: torch.Tensor | None = None, *, skip: int = 0,
                     split_heads: bool = False, rotate: bool = True) -> None:
        """Write the chunks ``keys`` (in order, ``T`` rows in all) into a caller's cache.

        ``dst_k``, ``dst_v``: per layer caches in the store's dtype and device, each viewed as
        ``[rows, Hkv, D]`` (contiguous, e.g. ``[num_pages, page_size, Hkv, D]``); with
        ``split_heads=True``, ``L * Hkv`` single-head caches instead (layer ``l``, head ``h`` at
        index ``l * Hkv + h``), each viewed as ``[rows, 1, D]``: for caches whose heads are not
        contiguous within a row, such as vLLM's ``[blocks, Hkv, block_size, 2 * D]`` pages.
        ``skip``: the first ``skip`` chunk tokens (of the ``T``, in order) are not written (the
        caller already holds them). ``dst_rows`` int64 ``[T - skip]``: the row of each written
        token, distinct; ``positions`` int ``[T - skip]`` (or None: keep the local positions): the
        RoPE position each key is rotated to (None: its local position ``j`` within its chunk; the
        pool holds keys position-free, so every gathered key is rotated once, by its position);
        ``rotate=False``: keys are written position-free (no RoPE; ``positions`` must be None), for
        a caller that rotates them itself (one rotation, by the target position).
        Chunks not in memory are loaded or recomputed first (evicting others, never these), so an
        unknown or corrupt chunk raises before anything is written. One ``copy_kv_`` per pool slab
        involved."""
        self._sync()
        entries, pinned = self._pin(keys)
        try:
            lens = [e.length for e in entries]
            total = sum(lens)
            if not 0 <= skip <= total:
                raise ChunkStoreError(f"ragattn.ChunkStore.gather_into_: skip={skip} is outside [0, {total}]")
            n = total - skip
            if tuple(dst_rows.shape) != (n,):
                raise ChunkStoreError(f"ragattn.ChunkStore.gather_into_: dst_rows has shape "
                                      f"{tuple(dst_rows.shape)}, expected ({n},) (the chunks' tokens)")
            want = self.num_layers * (self.num_kv_heads if split_heads else 1)
            if len(dst_k) != want or len(dst_v) != want:
                raise ChunkStoreError(f"ragattn.ChunkStore.gather_into_: expected {want} destination K and V "
                                      f"caches ({'layers x kv heads' if split_heads else 'layers'}), got "
                                      f"{len(dst_k)} and {len(dst_v)}")
            delta = self._local_positions(lens)[skip:] if rotate else None
            if positions is not None and not rotate:
                raise ChunkStoreError("ragattn.ChunkStore.gather_into_: positions with rotate=False (the keys "
                                      "stay position-free)")
            if positions is not None:
                if tuple(positions.shape) != (n,):
                    raise ChunkStoreError(f"ragattn.ChunkStore.gather_into_: positions has shape "
                                          f"{tuple(positions.shape)}, expected ({n},)")
                if positions.dtype not in (torch.int32, torch.int64):
                    raise ChunkStoreError(f"ragattn.ChunkStore.gather_into_: positions must be int32 or int64, "
                                          f"got {positions.dtype}")
                if n and (int(positions.min()) < 0 or int(positions.max()) > _MAX_POSITION):
                    # the rotation deltas are int32: a larger position would wrap around
                    raise ChunkStoreError(f"ragattn.ChunkStore.gather_into_: positions must be in [0, "
                                          f"{_MAX_POSITION}], got [{int(positions.min())}, {int(positions.max())}]")
                delta = positions.to(self.device, torch.int64)
            self._copy(entries, lens, dst_k, dst_v, dst_rows.to(self.device, torch.int64), delta, skip, split_heads)
        finally:
            self._unpin(pinned)

    def _local_positions(self, lens) -> torch.Tensor:
        """int64 ``[sum(lens)]``: ``0..n_i-1`` for each chunk."""
        total = sum(lens)
        starts = torch.tensor([0] + lens[:-1], dtype=torch.int64).cumsum(0)
        offs = torch.repeat_interleave(starts, torch.tensor(lens), output_size=total)
        return torch.arange(total, dtype=torch.int64).sub_(offs).to(self.device)

    def _copy(self, entries, lens, dst_k, dst_v, dst, delta, skip: int = 0, split_heads: bool = False):
        """Copy the chunks' tokens ``skip..T-1`` to rows ``dst``, keys rotated from position-free
        to ``delta`` (int64, each token's target position; None: left position-free)."""
        slabs = list({id(s): s for e in entries for s, _, _ in e.parts}.values())
        rot = (self._inv_freq, self.rope.rotary_dim, self.rope.interleaved) if delta is not None else (None, 0, False)
        if len(slabs) == 1:
            src = torch.cat([e.rows for e in entries]) if len(entries) > 1 else entries[0].rows
            _ops.copy_kv_(dst_k, dst_v, *self._pool.slab_layers(slabs[0], split_heads), src[skip:], dst, delta, *rot)
            return
        slab_of = torch.cat([torch.full((r,), slabs.index(s), dtype=torch.int64)
                             for e in entries for s, _, r in e.parts])[skip:].to(self.device)
        src_all = torch.cat([e.rows for e in entries])[skip:]
        for i, s in enumerate(slabs):
            sel = (slab_of == i).nonzero()[:, 0]
            if sel.numel() == 0:
                continue
            _ops.copy_kv_(dst_k, dst_v, *self._pool.slab_layers(s, split_heads), src_all[sel], dst[sel],
                          delta[sel] if delta is not None else None, *rot)

    def _request_cache(self, capacity: int, page_size: int) -> PagedKV:
        """A fresh batch-1 :class:`PagedKV`. On the CPU its memory is the buffer of a request cache
        that has died (when no view of it is left anywhere), so that assembling does not
        page-fault a new 30+ MB allocation in on every request (about as long as the copy
        itself); the buffer comes back when the returned cache is garbage-collected."""
        dims = (self.num_layers, 1, capacity, self.num_kv_heads, self.head_dim, page_size)
        if self.device.type != "cpu":   # the CUDA caching allocator already recycles
            return PagedKV(*dims, self.dtype, self.device)
        need = PagedKV.buffer_numel(*dims)
        spare = self._spare
        buf = spare.pop() if spare and spare[-1].numel() >= need and _sole_owner(spare[-1]) else None
        spare.clear()   # a buffer still viewed elsewhere, or too small: let it go
        if buf is None:
            buf = torch.empty(need, dtype=self.dtype, device=self.device)
        cache = PagedKV(*dims, self.dtype, self.device, buffer=buf)
        weakref.finalize(cache, _keep_spare, spare, buf)
        return cache

    @torch.no_grad()
    def request(self, keys: Sequence[str], positions="reordered", extra_slots: int = 0) -> ZeroCopyRequest:
        """A zero-copy request over the chunks ``keys`` (in this order): no K/V is copied; the
        request's page table points at the chunks' own (shared, position-free) pool pages with
        their positions, followed by ``ceil(extra_slots / page_size)`` private pages from the pool
        for the final block and the answer. The model then runs on ``req.cache`` through the
        "ragattn" attention (``ragattn_paged=req.cache`` or a ``PagedCache``), keys rotated in the
        kernel; a recompute that writes chunk slots copies their pages first (copy on write).

        ``positions``: "reordered" (chunk i from ``o_i``, consecutive), "composite" (every chunk
        from 0; the final block starts at ``max n_i``), or a sequence of ints: the first position
        of each chunk (any scheme: Block-Attention's offsets, gaps, overlaps); the final block
        starts after the furthest chunk end. Release with ``req.release()`` or ``with``."""
        self._sync()
        _check_chunks_and_extra("request", keys, extra_slots)
        if isinstance(positions, str):
            if positions not in ("reordered", "composite"):
                raise ChunkStoreError(f"ragattn.ChunkStore.request: positions must be 'reordered', 'composite' "
                                      f"or each chunk's first position, got {positions!r}")
            firsts = None
        else:
            firsts = [int(p) for p in positions]
            if len(firsts) != len(keys) or any(p < 0 for p in firsts):
                raise ChunkStoreError(f"ragattn.ChunkStore.request: positions must give one first position >= 0 "
                                      f"per chunk ({len(keys)}), got {list(positions)}")
        from ragattn.hf.tagged import TaggedPagedKV

        entries, pinned = self._pin(keys)
        private: list = []
        try:
            lens = [e.length for e in entries]
            starts = _chunk_starts(lens)
            if firsts is None:
                firsts = starts if positions == "reordered" else [0] * len(lens)
            next_pos = max(f + n for f, n in zip(firsts, lens))
            if next_pos + extra_slots > self.max_positions:
                raise ChunkStoreError(
                    f"ragattn.ChunkStore.request: chunks up to position {next_pos} + {extra_slots} extra slots "
                    f"exceed the model's window (max_position_embeddings={self.max_positions})")
            ps, pool = self.page_size, self._pool

            def alloc_page():
                parts = pool.alloc(ps, self._evict_one)
                private.extend(parts)
                slab, pages, _ = parts[0]
                return slab.k_pages, slab.v_pages, pages[0]

            cache = TaggedPagedKV(self.num_layers, self.num_kv_heads, self.head_dim, ps, self.dtype, self.device,
                                  self._inv_freq, self.rope.rotary_dim, self.rope.interleaved, alloc_page)
            for e, first in zip(entries, firsts):
                at = 0
                for slab, pages, r in e.parts:
                    valid = [min(ps, r - i * ps) for i in range(len(pages))]
                    pos = [first + at + i * ps for i in range(len(pages))]
                    cache.add_entries(slab.k_pages, slab.v_pages, pages, pos, valid)
                    at += r
            if extra_slots:
                parts = pool.alloc(extra_slots, self._evict_one)
                private.extend(parts)
                for slab, pages, _ in parts:
                    cache.add_private(slab.k_pages, slab.v_pages, pages)
        except BaseException:
            PagePool.free(private)
            self._unpin(pinned)
            raise
        release = weakref.finalize(cache, _release_request, pool, pinned, private, weakref.ref(cache))
        release.atexit = False
        pos = torch.cat([f + torch.arange(n, dtype=torch.int32) for f, n in zip(firsts, lens)])
        return ZeroCopyRequest(cache, starts, lens, pos, next_pos, release, ps * self.row_bytes)

    @torch.no_grad()
    def assemble(self, keys: Sequence[str], positions: str = "reordered", extra_slots: int = 0,
                 rerotate: bool = True, page_size: int | None = None) -> AssembledRequest:
        """Gather chunks (in this order) into a fresh paged request cache.

        ``positions``: "reordered" (chunk i at consecutive positions ``o_i + j``, keys re-rotated
        by ``o_i`` in the same ``copy_kv_`` pass) or "composite" (every chunk keeps ``0..n_i-1``;
        the final block starts at ``max n_i``). ``extra_slots``: room for the final block and the
        generated tokens. ``rerotate=False`` skips the rotation (wrong on purpose; for tests).
        """
        self._sync()
        if positions not in ("reordered", "composite"):
            raise ChunkStoreError(f"ragattn.ChunkStore.assemble: positions must be 'reordered' or "
                                  f"'composite', got {positions!r}")
        _check_chunks_and_extra("assemble", keys, extra_slots)
        if page_size is not None and (isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1):
            raise ChunkStoreError(f"ragattn.ChunkStore.assemble: page_size must be an integer >= 1 or None, "
                                  f"got {page_size!r}")
        entries, pinned = self._pin(keys)
        try:
            lens = [e.length for e in entries]
            starts = _chunk_starts(lens)
            total = sum(lens)
            next_pos = total if positions == "reordered" else max(lens)
            if next_pos + extra_slots > self.max_positions:
                raise ChunkStoreError(
                    f"ragattn.ChunkStore.assemble: {total} chunk tokens + {extra_slots} extra slots exceed "
                    f"the model's window (max_position_embeddings={self.max_positions})")
            cache = self._request_cache(total + extra_slots, page_size or self.page_size)
            slots = torch.arange(total, device=self.device)
            dst = cache.slot_rows(0, slots)
            if positions == "reordered":
                pos = slots.to(torch.int32)
            else:
                pos = self._local_positions(lens).to(torch.int32)
            # position-free keys are rotated to their slot's position (rerotate=False: to the
            # chunk-local ones, as if the chunks had not moved)
            self._copy(entries, lens, cache.k, cache.v, dst, pos.long() if rerotate else self._local_positions(lens))
        finally:
            self._unpin(pinned)
        cache.lengths[0] = total
        return AssembledRequest(cache, starts, lens, pos, next_pos)
