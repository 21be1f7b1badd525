"""The chunk KV store: precomputed per-chunk KV caches, in a bounded memory pool and on disk.

    from ragattn.methods.chunk_store import ChunkStore
    store = ChunkStore(model, directory="kv/")          # directory optional (memory only)
    keys = store.add([tok_ids_a, tok_ids_b, ...])       # one batched independent prefill of the misses
    req = store.assemble(keys, positions="reordered", extra_slots=64)
    # req.cache: ragattn.hf.attention.PagedKV holding the chunks' K/V at their request slots,
    # keys re-rotated to their request positions; req.next_position: RoPE position after the chunks.

Chunk K/V are computed by one ``varlen_attention`` forward over all missing chunks packed (one
sequence per chunk, positions 0..n-1 per chunk), so each chunk's keys are stored rotated at its
local positions ``0..n-1``. A chunk's key is ``sha256(model fingerprint, token ids)``. The model
fingerprint (:func:`model_fingerprint`) hashes the model's config (every value but the attention
implementation and the path it was loaded from) and a checksum of every weight and buffer (two
exact int64 sums over each tensor's bytes: any changed bit changes it), recomputed at every store creation (about 0.1 s for
SmolLM2-135M on one CPU core): a store built before a fine-tuning step or a config change never
serves its chunks to the changed model, in memory or from disk.

Public API (for the methods, FusionRAG's offline fusion and serving-engine connectors)
---------------------------------------------------------------------------------------
* ``store.key(tokens)`` -> key of a chunk (token ids: a list or an int tensor);
  ``store.variant_key(key, variant)`` -> key of a derived entry of that chunk.
* ``store.add(chunks)`` -> keys: stores every chunk (prefills the misses, loads disk hits).
* ``store.put(key, variant, k_layers, v_layers)`` -> derived key: stores a variant of chunk ``key``
  (e.g. FusionRAG's fused cache: the same tokens prefilled after other context, keys re-rotated
  back to the chunk's local positions ``0..n-1``), per layer ``[n, Hkv, D]``; it is keyed, saved,
  loaded, verified, evicted and assembled exactly like a chunk.
* ``store.has(key)`` / ``store.lookup(keys)``: whether a key is in memory or in the directory
  (nothing is loaded).
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

Memory: a byte budget, LRU eviction, no 2x growth
--------------------------------------------------
The in-memory pool holds at most ``memory_budget`` bytes of K/V (default: a quarter of the
memory available on the model's device when the store is created; see :func:`default_budget`).
It is made of *slabs* (per layer ``[rows, Hkv, D]`` K and V tensors) cut into pages of
``page_size`` rows; a chunk is a list of pages of one slab. The pool grows by adding a slab (never
by copying into a larger one: no transient 2x peak), and when the budget is reached it evicts the
least recently used chunks (``add`` hits and ``assemble`` count as uses) and reuses their pages.
An evicted chunk reloads bit-exact from the directory when it was saved there; a chunk computed
without a (writable) directory is recomputed from its tokens (kept in host memory, 8 bytes a
token) on its next use; a derived entry
that exists only in memory is dropped (``has`` turns False; build it again). ``pool_bytes`` is
the pool's allocated size (never above the budget), ``num_rows`` the tokens held.

Assembled requests use *copy-out* semantics: :meth:`assemble` / :meth:`gather_into_` copy the
chunks' rows into the request's own cache, so an ``AssembledRequest`` never refers to pool
memory and later evictions cannot change it. During one call every chunk it gathers is pinned,
so loading or recomputing one of them never evicts another; a request whose chunks alone exceed
the budget is refused (``ChunkStoreError``). The store is not thread-safe.

:meth:`ChunkStore.pooled_kv` copies the whole pool out (e.g. to pinned host memory) and
:meth:`ChunkStore.load_pooled_kv_` copies it back, for keeping chunk KV off the GPU; a copy taken
before chunks were added, evicted or overwritten is refused.

On disk: one ``<key>.safetensors`` per chunk (``k``, ``v`` ``[L, n, Hkv, D]``, ``tokens`` int64
``[n]``) with metadata (format, model fingerprint, key, sha256 of the tensor bytes). A file is
written (atomically) before its chunk enters the pool, and fully read and verified before
anything is inserted: a truncated, corrupt or foreign (other fingerprint) file raises
``ChunkStoreError`` and is never loaded in part. A directory that cannot be written is refused at
creation, naming it, unless ``read_only=True`` (serve the chunks in it; new chunks stay in memory).
"""
from __future__ import annotations

import hashlib
import json
import os
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

FORMAT = "ragattn-chunk-kv-v1"
DEFAULT_BUDGET_FRACTION = 0.25   # of the device's available memory, when no budget is given
_FIRST_SLAB_BYTES = 64 << 20    # first slab at most (and two model windows, and the budget's
_FIRST_SLAB_PAGES = 16          # quarter), at least 16 pages: a typical request spans one slab
_WORDS_PER_ROW = 64              # checksum rows: 64 int64 words (512 bytes) each


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


class ChunkStoreError(ValueError):
    """A chunk or a chunk file that cannot be used (bad input, mismatched model, corrupt file,
    unwritable directory, memory budget too small)."""


# ----- fingerprint ------------------------------------------------------------------------------
def _config_json(model) -> str:
    cfg = model.config.to_dict()
    # not what the model is: its attention kernel, and the path it was loaded from (a store built
    # from "org/model" serves the same weights loaded from /abs/path/model, e.g. by vLLM)
    for k in ("_attn_implementation_autoset", "_attn_implementation", "attn_implementation", "_name_or_path"):
        cfg.pop(k, None)
    return json.dumps(cfg, sort_keys=True, default=str)


def _named_state(model) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer (persistent or not: RoPE's ``inv_freq`` is not in the state
    dict), tied tensors once."""
    return [*model.named_parameters(), *model.named_buffers()]


def weight_checksums(tensors: Sequence[torch.Tensor]) -> list[bytes]:
    """An exact checksum of each tensor's bytes, computed on its device (one host sync in all).

    The bytes are read as int64 words in rows of 64: ``sum(words)`` and ``sum((r + 1) *
    rowsum_r)`` (mod 2^64) detect any change of any bit and any move of data between rows; the
    tail (< 512 bytes) is hashed as is. Integer sums are order-independent, so the result is the
    same on every device. Returns 16 bytes + tail per tensor."""
    sums, tails = [], []
    for t in tensors:
        t = t.detach()
        if t.device.type == "meta":
            raise ChunkStoreError("ragattn.ChunkStore: cannot fingerprint a model with weights on the "
                                  "meta device (offloaded or not materialised)")
        b = t.contiguous().reshape(-1).view(torch.uint8)
        rows = b.numel() // (8 * _WORDS_PER_ROW)
        main = b[: rows * 8 * _WORDS_PER_ROW]
        if main.data_ptr() % 8:
            main = main.clone()
        r = main.view(torch.int64).view(rows, _WORDS_PER_ROW).sum(1)
        w = torch.arange(1, rows + 1, dtype=torch.int64, device=r.device)
        sums.append(torch.stack([r.sum(), (r * w).sum()]))
        tails.append(b[rows * 8 * _WORDS_PER_ROW:])
    if not sums:
        return []
    if len({s.device for s in sums}) == 1:   # one device-to-host copy each (one sync)
        host = torch.stack(sums).cpu().numpy()
        tail_all = torch.cat(tails).cpu().numpy().tobytes()
    else:                                     # a model spread over devices
        host = torch.stack([s.cpu() for s in sums]).numpy()
        tail_all = b"".join(x.cpu().numpy().tobytes() for x in tails)
    out, at = [], 0
    for i, x in enumerate(tails):
        out.append(host[i].tobytes() + tail_all[at: at + x.numel()])
        at += x.numel()
    return out


def _state_versions(named):
    """(id, data_ptr, version) of every tensor, or None when one has no version counter."""
    try:
        return tuple((id(t), t.data_ptr(), t._version) for _, t in named)
    except RuntimeError:  # inference tensors track no version
        return None


def model_fingerprint(model, cached: bool = True) -> str:
    """Hex fingerprint of a model: its config (all but the attention implementation and the path
    it was loaded from) and an exact checksum of every parameter and buffer
    (:func:`weight_checksums`) with names, shapes, dtypes.

    ``cached=True`` reuses the last value while the config and every tensor's identity and
    in-place version counter are unchanged (cheap: for per-request checks); writes that bypass
    the version counter (``p.data.copy_(...)``) are only seen with ``cached=False``, which
    :class:`ChunkStore` uses at creation."""
    named = _named_state(model)
    cfg = _config_json(model)
    state = (cfg, _state_versions(named))
    hit = getattr(model, "_ragattn_fingerprint_cache", None)
    if cached and state[1] is not None and hit is not None and hit[0] == state:
        return hit[1]
    h = hashlib.sha256(cfg.encode())
    for (name, t), digest in zip(named, weight_checksums([t for _, t in named])):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(digest)
    fp = h.hexdigest()[:32]
    model._ragattn_fingerprint_cache = (state, fp)
    return fp


def chunk_key(fingerprint: str, tokens) -> str:
    """``sha256(fingerprint, int64 token bytes)`` (40 hex digits); ``tokens``: ids or an int tensor."""
    t = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    t = np.ascontiguousarray(t.reshape(-1), dtype=np.int64)
    return hashlib.sha256(fingerprint.encode() + t.tobytes()).hexdigest()[:40]


def variant_key(fingerprint: str, key: str, variant: str) -> str:
    return hashlib.sha256(f"{fingerprint}:{key}:{variant}".encode()).hexdigest()[:40]


def _tensor_digest(*ts: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in ts:
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def default_budget(device: torch.device | str) -> int:
    """The default ``memory_budget``: ``DEFAULT_BUDGET_FRACTION`` of the memory available on
    ``device`` now (CUDA: free device memory; CPU: ``MemAvailable``)."""
    return int(_available_bytes(torch.device(device)) * DEFAULT_BUDGET_FRACTION)


# ----- pool -------------------------------------------------------------------------------------
class _Slab:
    """A piece of the pool: per layer ``[pages * page_size, Hkv, D]`` K and V, and its free pages."""

    def __init__(self, store: "ChunkStore", pages: int):
        rows = pages * store.page_size
        shape = (rows, store.num_kv_heads, store.head_dim)
        self.k = [torch.empty(shape, dtype=store.dtype, device=store.device) for _ in range(store.num_layers)]
        self.v = [torch.empty(shape, dtype=store.dtype, device=store.device) for _ in range(store.num_layers)]
        self.pages = pages
        self.free = list(range(pages - 1, -1, -1))  # popped from the end: low pages first


@dataclass(eq=False)
class _Entry:
    tokens: torch.Tensor          # int64 [n], CPU
    slab: _Slab
    pages: list[int]
    rows: torch.Tensor            # int64 [n]: the chunk's rows in its slab, on the store's device
    on_disk: bool                 # a verified file of it is in the store's directory
    variant: tuple[str, str] | None = None   # (chunk key, variant name) of a derived entry
    pins: int = field(default=0)

    @property
    def length(self) -> int:
        return int(self.tokens.numel())


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
    ``read_only``: never write to ``directory`` (chunks computed here stay in memory only).
    ``fingerprint``, ``device``: a fingerprint computed elsewhere and the store's device, for a
    model whose parameters are not materialised (the vLLM worker: ragattn.vllm.fingerprint); such a
    store can only serve chunks from ``directory``."""

    def __init__(self, model, directory: str | os.PathLike | None = None, page_size: int = 16,
                 max_batch_tokens: int = 8192, *, memory_budget: int | None = None,
                 read_only: bool = False, fingerprint: str | None = None, device=None):
        if page_size < 1 or max_batch_tokens < 1:
            raise ChunkStoreError(f"ragattn.ChunkStore: page_size and max_batch_tokens must be >= 1, "
                                  f"got {page_size} and {max_batch_tokens}")
        self.model = model
        self.config = model.config
        self.rope: RopeParams = rope_params(model)
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
        if self.directory is not None:
            self._open_directory()
        self.row_bytes = 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        budget = default_budget(self.device) if memory_budget is None else int(memory_budget)
        if budget < self.row_bytes * page_size:
            raise ChunkStoreError(f"ragattn.ChunkStore: memory_budget={budget} bytes is below one page "
                                  f"({page_size} rows x {self.row_bytes} bytes)")
        self.memory_budget = budget
        self._budget_pages = budget // (self.row_bytes * page_size)
        self._slabs: list[_Slab] = []
        self._entries: "OrderedDict[str, _Entry]" = OrderedDict()   # LRU order: oldest first
        self._recomputable: dict[str, torch.Tensor] = {}            # evicted, not on disk: tokens
        self._layout = 0     # bumped whenever pool rows change meaning (insert, evict, overwrite)
        self._pooled_layout = None
        self._inv_freq = self.rope.inv_freq.to(self.device)
        self._spare: list[torch.Tensor] = []   # at most one request-cache buffer (_request_cache)
        # counters: chunks computed, recomputed after eviction, loaded from disk; entries evicted
        self.stats = {"computed": 0, "recomputed": 0, "loaded": 0, "evicted": 0}

    def _open_directory(self):
        d = self.directory
        if self.read_only:
            if not d.is_dir():
                raise ChunkStoreError(f"ragattn.ChunkStore: directory {d} does not exist (read_only=True)")
            return
        probe = d / f".ragattn-write-probe-{os.getpid()}"
        try:
            d.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ChunkStoreError(
                f"ragattn.ChunkStore: cannot write chunk files to directory {d} ({exc.strerror or exc}); "
                "pass read_only=True to serve the chunks already in it") from None

    # ----- pool ---------------------------------------------------------------------------
    @property
    def pool_bytes(self) -> int:
        """Bytes of K/V the pool has allocated (all slabs); never above ``memory_budget``."""
        return sum(s.pages for s in self._slabs) * self.page_size * self.row_bytes

    @property
    def num_rows(self) -> int:
        """Tokens of every chunk in memory."""
        return sum(e.length for e in self._entries.values())

    @property
    def pool_rows(self) -> int:
        """Rows the pool has allocated (``pool_bytes / row_bytes``), the rows of :meth:`pooled_kv`."""
        return sum(s.pages for s in self._slabs) * self.page_size

    def _alloc(self, n: int) -> tuple[_Slab, list[int]]:
        """Pages for ``n`` rows in one slab: free pages, else a new slab within the budget, else
        (releasing empty slabs and) evicting the least recently used unpinned chunks."""
        m = -(-n // self.page_size)
        if m > self._budget_pages:
            raise ChunkStoreError(
                f"ragattn.ChunkStore: a chunk of {n} tokens needs {m * self.page_size * self.row_bytes} "
                f"bytes, more than the memory budget ({self.memory_budget} bytes)")
        while True:
            for s in self._slabs:
                if len(s.free) >= m:
                    pages = s.free[-m:][::-1]
                    del s.free[-m:]
                    return s, pages
            cap = sum(s.pages for s in self._slabs)
            room = self._budget_pages - cap
            if room >= m:
                # grow geometrically (few slabs), at most a quarter of the budget at once
                first = max(_FIRST_SLAB_PAGES, min(_FIRST_SLAB_BYTES // (self.page_size * self.row_bytes),
                                                   -(-2 * self.max_positions // self.page_size)))
                want = min(max(m, cap, first), max(m, self._budget_pages // 4), room)
                self._slabs.append(_Slab(self, want))
                continue
            empty = [s for s in self._slabs if len(s.free) == s.pages]
            if empty:
                self._slabs = [s for s in self._slabs if len(s.free) != s.pages]
                continue
            if not self._evict_one():
                raise ChunkStoreError(
                    f"ragattn.ChunkStore: memory budget ({self.memory_budget} bytes) too small: the "
                    f"chunks one request uses do not fit in it together")

    def _evict_one(self) -> bool:
        for key, e in self._entries.items():
            if e.pins == 0:
                self._evict(key)
                return True
        return False

    def _evict(self, key: str) -> None:
        e = self._entries.pop(key)
        e.slab.free.extend(e.pages)
        self.stats["evicted"] += 1
        if not e.on_disk and e.variant is None:
            self._recomputable[key] = e.tokens
        self._layout += 1

    def _insert(self, key, tokens, k_layers, v_layers, on_disk: bool, variant=None) -> _Entry:
        """Copy per-layer ``[n, Hkv, D]`` K/V (any device/dtype-compatible) into fresh pages."""
        n = int(tokens.numel())
        slab, pages = self._alloc(n)
        ps = self.page_size
        rows = (torch.tensor(pages, dtype=torch.int64)[:, None] * ps + torch.arange(ps)).reshape(-1)[:n]
        rows = rows.to(self.device)
        for dst, src in ((slab.k, k_layers), (slab.v, v_layers)):
            for l in range(self.num_layers):
                dst[l].index_copy_(0, rows, src[l].to(self.device, self.dtype))
        e = _Entry(tokens.to("cpu", torch.int64), slab, pages, rows, on_disk, variant)
        self._entries[key] = e
        self._recomputable.pop(key, None)
        self._layout += 1
        return e

    def pooled_kv(self, device: str | torch.device = "cpu", pin_memory: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the whole in-memory pool, e.g. to keep the chunk KV in host memory.

        Returns K, V: ``[L, pool_rows, Hkv, D]`` each (every allocated pool row, the slabs in
        order; rows of free pages hold garbage), in the model's dtype, on ``device``;
        ``pin_memory=True`` (CPU ``device`` only, needs CUDA) allocates them in page-locked
        memory so that :meth:`load_pooled_kv_` can copy them to the GPU asynchronously. The copy
        is only meaningful to this store while no chunk is added, evicted or overwritten.
        Keys are rotated at each chunk's local positions ``0..n-1``."""
        device = torch.device(device)
        if pin_memory and device.type != "cpu":
            raise ChunkStoreError(f"ragattn.ChunkStore.pooled_kv: pin_memory needs device 'cpu', "
                                  f"got {device}")
        shape = (self.num_layers, self.pool_rows, self.num_kv_heads, self.head_dim)
        out = []
        for which in ("k", "v"):
            t = torch.empty(shape, dtype=self.dtype, device=device, pin_memory=pin_memory)
            r = 0
            for s in self._slabs:
                layers = getattr(s, which)
                for l in range(self.num_layers):
                    t[l, r: r + layers[l].shape[0]].copy_(layers[l])
                r += layers[0].shape[0]
            out.append(t)
        self._pooled_layout = self._layout
        return out[0], out[1]

    def load_pooled_kv_(self, k: torch.Tensor, v: torch.Tensor, non_blocking: bool = False) -> None:
        """Overwrite the in-memory pool with ``k``, ``v`` from :meth:`pooled_kv` (any device).

        ``k``, ``v``: ``[L, pool_rows, Hkv, D]`` in the store's dtype, copied from this store
        since its last change: after a chunk was added, evicted or overwritten the copy is stale
        (``ChunkStoreError``). ``non_blocking=True`` with pinned host tensors makes the
        host-to-device copies asynchronous (ordered on the current stream before later kernels)."""
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
        if self._pooled_layout != self._layout:
            raise ChunkStoreError("ragattn.ChunkStore.load_pooled_kv_: the pool changed (chunks added, "
                                  "evicted or overwritten) since pooled_kv() was taken: the copy is stale")
        for which, src in (("k", k), ("v", v)):
            r = 0
            for s in self._slabs:
                layers = getattr(s, which)
                n = layers[0].shape[0]
                for l in range(self.num_layers):
                    layers[l].copy_(src[l, r: r + n], non_blocking=non_blocking)
                r += n

    # ----- lookup ---------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, tokens) -> str:
        """Key of a chunk: ``tokens`` a sequence of ids or an int tensor."""
        return chunk_key(self.fingerprint, tokens)

    def variant_key(self, key: str, variant: str) -> str:
        """Key of the derived entry ``variant`` (a name, e.g. "fused-...") of the chunk ``key``."""
        return variant_key(self.fingerprint, key, variant)

    def has(self, key: str) -> bool:
        """Whether ``key`` is in memory or on disk in the store's directory (nothing is loaded)."""
        return key in self._entries or (self.directory is not None and self._path(key).is_file())

    def lookup(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`has` of each key."""
        return [self.has(k) for k in keys]

    def put(self, key: str, variant: str, k_layers: Sequence[torch.Tensor],
            v_layers: Sequence[torch.Tensor]) -> str:
        """Store a derived entry of the chunk ``key`` (which must be in the store); returns its key.

        ``k_layers``, ``v_layers``: per layer ``[n, Hkv, D]`` (``n`` = the chunk's tokens), keys
        rotated at the chunk's local positions ``0..n-1``. Written to the directory, if any,
        before it enters the pool; an existing entry of that variant is replaced."""
        tokens = self._tokens_of(key)
        want = (tokens.numel(), self.num_kv_heads, self.head_dim)
        if len(k_layers) != self.num_layers or len(v_layers) != self.num_layers or any(
                tuple(t.shape) != want for t in [*k_layers, *v_layers]):
            raise ChunkStoreError(f"ragattn.ChunkStore.put: expected {self.num_layers} layers of K and "
                                  f"V of shape {want} ([n, Hkv, D])")
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
        """K, V of a stored chunk: per layer ``[n, Hkv, D]`` copies (keys at local positions)."""
        e = self._get(key)
        return [p.index_select(0, e.rows) for p in e.slab.k], [p.index_select(0, e.rows) for p in e.slab.v]

    def kv(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of a stored chunk: ``[L, n, Hkv, D]`` each (copies; keys at local positions)."""
        k, v = self.get_kv(key)
        return torch.stack(k), torch.stack(v)

    def tokens(self, key: str) -> torch.Tensor:
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
            if self.directory is not None and self._path(key).is_file():
                self.load(key)
            elif key in self._recomputable:
                self._prefill([(key, self._recomputable[key])])
            e = self._entries.get(key)
            if e is None:
                raise ChunkStoreError(f"ragattn.ChunkStore: no chunk with key {key!r} in the store")
        else:
            self._entries.move_to_end(key)
        return e

    # ----- compute --------------------------------------------------------------------------
    @property
    def _writable(self) -> bool:
        return self.directory is not None and not self.read_only

    def _check_tokens(self, chunks) -> list[np.ndarray]:
        """Each chunk as a 1-D int64 array (numpy: no torch dispatch per chunk on the hot path)."""
        toks = []
        for c in chunks:
            a = c.detach().cpu().numpy() if isinstance(c, torch.Tensor) else np.asarray(c)
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
            if self.directory is not None and self._path(k).is_file():
                self.load(k)
                continue
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
            self.stats["recomputed" if key in self._recomputable else "computed"] += 1
            e = self._insert(key, t, k_layers, v_layers, on_disk=self._writable)
            if pinned is not None:
                e.pins += 1
                pinned.append(e)

    # ----- disk -----------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.safetensors"

    def _write_file(self, key, tokens, k, v, variant=None, directory: Path | None = None) -> Path:
        """Write ``k``, ``v`` ``[L, n, Hkv, D]`` and ``tokens`` to ``<directory>/<key>.safetensors``
        atomically (temporary file, then rename)."""
        from safetensors.torch import save

        d = self.directory if directory is None else directory
        k, v = k.detach().cpu().contiguous(), v.detach().cpu().contiguous()
        tokens = tokens.to("cpu", torch.int64).contiguous()
        meta = {"format": FORMAT, "fingerprint": self.fingerprint, "key": key,
                "num_tokens": str(tokens.numel()), "sha256": _tensor_digest(k, v, tokens)}
        if variant is not None:
            meta["variant"] = variant[1]
        path = d / f"{key}.safetensors"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            data = save({"k": k, "v": v, "tokens": tokens}, metadata=meta)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            raise ChunkStoreError(f"ragattn.ChunkStore: cannot write {path.name} to directory {d} "
                                  f"({exc.strerror or exc})") from None
        return path

    def save(self, key: str, directory: str | os.PathLike | None = None) -> Path:
        """Write a chunk to ``<directory>/<key>.safetensors`` atomically; returns the path."""
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
        k, v = self.kv(key)
        path = self._write_file(key, e.tokens, k, v, e.variant, d)
        if directory is None:
            e.on_disk = True
        return path

    def load(self, key_or_path: str | os.PathLike) -> str:
        """Load and verify one chunk file (by key in the store's directory, or by path); returns its key."""
        from safetensors import safe_open

        p = Path(key_or_path)
        if not p.suffix == ".safetensors":
            if self.directory is None:
                raise ChunkStoreError("ragattn.ChunkStore.load: a bare key needs a store directory")
            p = self._path(str(key_or_path))
        try:
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {n: f.get_tensor(n) for n in ("k", "v", "tokens")}
        except Exception as exc:  # truncated / not safetensors / missing tensor
            raise ChunkStoreError(f"ragattn.ChunkStore.load: {p} is not a complete chunk file "
                                  f"({type(exc).__name__}: {exc})") from exc
        if meta.get("format") != FORMAT:
            raise ChunkStoreError(f"ragattn.ChunkStore.load: {p} has format {meta.get('format')!r}, "
                                  f"expected {FORMAT!r}")
        if meta.get("fingerprint") != self.fingerprint:
            raise ChunkStoreError(
                f"ragattn.ChunkStore.load: {p} was computed by another model (fingerprint "
                f"{meta.get('fingerprint')!r}, this model {self.fingerprint!r})")
        k, v, tokens = tensors["k"], tensors["v"], tensors["tokens"]
        want = (self.num_layers, tokens.numel(), self.num_kv_heads, self.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want or k.dtype != self.dtype or v.dtype != self.dtype:
            raise ChunkStoreError(f"ragattn.ChunkStore.load: {p} holds K/V of shape {tuple(k.shape)} "
                                  f"{k.dtype}, expected {want} {self.dtype}")
        if _tensor_digest(k, v, tokens) != meta.get("sha256"):
            raise ChunkStoreError(f"ragattn.ChunkStore.load: {p} fails its checksum (corrupt file)")
        key = chunk_key(self.fingerprint, tokens)
        variant = meta.get("variant")
        if variant is not None:
            base, key = key, variant_key(self.fingerprint, key, variant)
        if key != meta.get("key"):
            raise ChunkStoreError(f"ragattn.ChunkStore.load: {p} holds key {meta.get('key')!r}, "
                                  f"but its tokens hash to {key!r}")
        if key in self._entries:
            self._entries.move_to_end(key)
        else:
            on_disk = self.directory is not None and p.resolve() == self._path(key).resolve()
            self.stats["loaded"] += 1
            self._insert(key, tokens, k, v, on_disk, (base, variant) if variant is not None else None)
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
                if k in self._recomputable and not (self.directory is not None and self._path(k).is_file()):
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
                     split_heads: bool = False) -> None:
        """Write the chunks ``keys`` (in order, ``T`` rows in all) into a caller's cache.

        ``dst_k``, ``dst_v``: per layer caches in the store's dtype and device, each viewed as
        ``[rows, Hkv, D]`` (contiguous, e.g. ``[num_pages, page_size, Hkv, D]``); with
        ``split_heads=True``, ``L * Hkv`` single-head caches instead (layer ``l``, head ``h`` at
        index ``l * Hkv + h``), each viewed as ``[rows, 1, D]``: for caches whose heads are not
        contiguous within a row, such as vLLM's ``[blocks, Hkv, block_size, 2 * D]`` pages.
        ``skip``: the first ``skip`` chunk tokens (of the ``T``, in order) are not written (the
        caller already holds them). ``dst_rows`` int64 ``[T - skip]``: the row of each written
        token, distinct; ``positions`` int ``[T - skip]`` (or None: keep the local positions): the
        RoPE position each key is re-rotated to (from its local position ``j`` within its chunk).
        Chunks not in memory are loaded or recomputed first (evicting others, never these), so an
        unknown or corrupt chunk raises before anything is written. One ``copy_kv_`` per pool slab
        involved."""
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
            delta = None
            if positions is not None:
                if tuple(positions.shape) != (n,):
                    raise ChunkStoreError(f"ragattn.ChunkStore.gather_into_: positions has shape "
                                          f"{tuple(positions.shape)}, expected ({n},)")
                delta = (positions.to(self.device, torch.int64) - self._local_positions(lens)[skip:]).to(torch.int32)
            self._copy(entries, lens, dst_k, dst_v, dst_rows.to(self.device, torch.int64), delta, skip, split_heads)
        finally:
            self._unpin(pinned)

    def _local_positions(self, lens) -> torch.Tensor:
        """int64 ``[sum(lens)]``: ``0..n_i-1`` for each chunk."""
        total = sum(lens)
        starts = torch.tensor([0] + lens[:-1], dtype=torch.int64).cumsum(0)
        offs = torch.repeat_interleave(starts, torch.tensor(lens), output_size=total)
        return torch.arange(total, dtype=torch.int64).sub_(offs).to(self.device)

    def _slab_layers(self, slab: _Slab, split_heads: bool):
        if not split_heads:
            return slab.k, slab.v
        hs = range(self.num_kv_heads)
        return ([k[:, h:h + 1] for k in slab.k for h in hs], [v[:, h:h + 1] for v in slab.v for h in hs])

    def _copy(self, entries, lens, dst_k, dst_v, dst, delta, skip: int = 0, split_heads: bool = False):
        """Copy the chunks' tokens ``skip..T-1`` to rows ``dst`` (``delta``: rotation of each)."""
        slabs = list({id(e.slab): e.slab for e in entries}.values())
        rot = (self._inv_freq, self.rope.rotary_dim, self.rope.interleaved) if delta is not None else (None, 0, False)
        if len(slabs) == 1:
            src = torch.cat([e.rows for e in entries]) if len(entries) > 1 else entries[0].rows
            _ops.copy_kv_(dst_k, dst_v, *self._slab_layers(slabs[0], split_heads), src[skip:], dst, delta, *rot)
            return
        slab_of = torch.cat([torch.full((n,), slabs.index(e.slab), dtype=torch.int64)
                             for e, n in zip(entries, lens)])[skip:].to(self.device)
        src_all = torch.cat([e.rows for e in entries])[skip:]
        for i, s in enumerate(slabs):
            sel = (slab_of == i).nonzero()[:, 0]
            if sel.numel() == 0:
                continue
            _ops.copy_kv_(dst_k, dst_v, *self._slab_layers(s, split_heads), src_all[sel], dst[sel],
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
    def assemble(self, keys: Sequence[str], positions: str = "reordered", extra_slots: int = 0,
                 rerotate: bool = True, page_size: int | None = None) -> AssembledRequest:
        """Gather chunks (in this order) into a fresh paged request cache.

        ``positions``: "reordered" (chunk i at consecutive positions ``o_i + j``, keys re-rotated
        by ``o_i`` in the same ``copy_kv_`` pass) or "composite" (every chunk keeps ``0..n_i-1``;
        the final block starts at ``max n_i``). ``extra_slots``: room for the final block and the
        generated tokens. ``rerotate=False`` skips the rotation (wrong on purpose; for tests).
        """
        if positions not in ("reordered", "composite"):
            raise ChunkStoreError(f"ragattn.ChunkStore.assemble: positions must be 'reordered' or "
                                  f"'composite', got {positions!r}")
        if len(keys) == 0:
            raise ChunkStoreError("ragattn.ChunkStore.assemble: no chunks given (empty retrieval)")
        entries, pinned = self._pin(keys)
        try:
            lens = [e.length for e in entries]
            starts = [0]
            for n in lens[:-1]:
                starts.append(starts[-1] + n)
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
            # reordered: chunk i moves by its start (chunk 0 by 0); composite: nothing moves
            delta = None
            if rerotate and positions == "reordered" and len(lens) > 1:
                delta = (slots - self._local_positions(lens)).to(torch.int32)
            self._copy(entries, lens, cache.k, cache.v, dst, delta)
        finally:
            self._unpin(pinned)
        cache.lengths[0] = total
        return AssembledRequest(cache, starts, lens, pos, next_pos)
