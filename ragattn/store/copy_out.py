"""Copy-out requests over the resident set: the chunks' rows copied into a caller's cache
(``ChunkStore.gather_into_``, e.g. vLLM's paged caches) or into a fresh batch-1 paged request
cache (``ChunkStore.assemble`` -> :class:`AssembledRequest`), keys rotated to their request
positions in the same ``ragattn.copy_kv_`` pass (docs/chunk-store.md: copy-out semantics).

    builder = CopyOutBuilder(resident, loader.pin)
    builder.gather_into_(keys, dst_k, dst_v, dst_rows, positions)
    req = builder.assemble(keys, positions="reordered", extra_slots=64)
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from ragattn import ops as _ops
from ragattn.kv import PagedKV
from ragattn.store.errors import ChunkStoreError
from ragattn.store.positions import Positions

_MAX_POSITION = (1 << 31) - 1   # rotation deltas are int32


def _check_chunks_and_extra(method: str, keys, extra_slots) -> None:
    """The arguments ``ChunkStore.request`` and ``ChunkStore.assemble`` share: at least one chunk,
    and ``extra_slots`` an int >= 0."""
    if len(keys) == 0:
        raise ChunkStoreError(f"ragattn.ChunkStore.{method}: no chunks given (empty retrieval)")
    if isinstance(extra_slots, bool) or not isinstance(extra_slots, int) or extra_slots < 0:
        raise ChunkStoreError(f"ragattn.ChunkStore.{method}: extra_slots must be an integer >= 0, "
                              f"got {extra_slots!r}")


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


@dataclass
class AssembledRequest:
    """A request cache filled with chunks. ``cache`` holds ``num_slots`` slots (row 0 of a batch-1
    ``ragattn.kv.PagedKV``); ``chunk_starts[i]``/``chunk_lens[i]`` are chunk i's slots,
    ``positions`` int32 ``[num_slots]`` the RoPE position of each slot, ``next_position`` where the
    final block starts. The cache is the request's own copy (see the module docstring: copy-out
    semantics)."""
    cache: object
    chunk_starts: list[int]
    chunk_lens: list[int]
    positions: torch.Tensor
    next_position: int

    @property
    def num_slots(self) -> int:
        return int(self.cache.lengths[0])


def is_layer_range(layers, num_layers: int) -> bool:
    """Whether ``layers`` is a run of a model's ``num_layers`` layers: a non-empty step-1 ``range``
    within ``[0, num_layers)`` (a pipeline stage's, for instance)."""
    return isinstance(layers, range) and layers.step == 1 and len(layers) > 0 and layers.start >= 0 \
        and layers.stop <= num_layers


class CopyOutBuilder:
    """Copy-out assembly over a :class:`~ragattn.store.resident.ResidentSet`: gathers into any
    cache, and fresh request caches with buffer recycling. ``pin(keys) -> (entries, pinned)``
    makes the chunks resident and pins them (the loader's :meth:`~ragattn.store.loader.Loader.pin`)."""

    def __init__(self, resident, pin):
        self.resident, self._pin = resident, pin
        p = resident.pool
        self.num_layers, self.num_kv_heads, self.head_dim = p.num_layers, p.num_kv_heads, p.head_dim
        self.dtype, self.device, self.page_size, self.max_positions = p.dtype, p.device, p.page_size, p.max_positions
        self._spare: list[torch.Tensor] = []   # at most one request-cache buffer (_request_cache)

    @torch.no_grad()
    def gather_into_(self, keys: Sequence[str], dst_k: Sequence[torch.Tensor], dst_v: Sequence[torch.Tensor],
                     dst_rows: torch.Tensor, positions: torch.Tensor | None = None, *, skip: int = 0,
                     split_heads: bool = False, heads: range | None = None, layers: range | None = None) -> None:
        """Write the chunks ``keys`` (in order, ``T`` rows in all) into a caller's cache.

        ``dst_k``, ``dst_v``: per layer caches in the store's dtype and device, each viewed as
        ``[rows, Hkv, D]`` (contiguous, e.g. ``[num_pages, page_size, Hkv, D]``); with
        ``split_heads=True``, ``L * Hkv`` single-head caches instead (layer ``l``, head ``h`` at
        index ``l * Hkv + h``), each viewed as ``[rows, 1, D]``: for caches whose heads are not
        contiguous within a row, such as vLLM's ``[blocks, Hkv, block_size, 2 * D]`` pages;
        ``heads`` (with ``split_heads``; a ``range`` within ``[0, Hkv)``, default all): only these KV
        heads are written, ``L * len(heads)`` caches (layer ``l``, head ``heads[i]`` at ``l *
        len(heads) + i``), e.g. a tensor-parallel rank's share of the heads. ``layers`` (a
        ``range`` within ``[0, L)``, default all): only these layers are written, ``len(layers)``
        destinations per head in that order (e.g. a pipeline-parallel stage's layers).
        ``skip``: the first ``skip`` chunk tokens (of the ``T``, in order) are not written (the
        caller already holds them). ``dst_rows`` int64 ``[T - skip]``: the row of each written
        token, distinct; ``positions`` int ``[T - skip]`` (or None: keep the local positions): the
        RoPE position each key is rotated to (None: its local position ``j`` within its chunk;
        the pool holds each key rotated by its page offset, so every gathered key is rotated once,
        from there to its position; 0 leaves it without RoPE, a destination page offset puts it in
        the pool's form there, for a kernel that rotates keys itself).
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
            heads = self._heads(heads, split_heads)
            layers = self._layers(layers)
            want = len(layers) * (len(heads) if split_heads else 1)
            if len(dst_k) != want or len(dst_v) != want:
                raise ChunkStoreError(f"ragattn.ChunkStore.gather_into_: expected {want} destination K and V "
                                      f"caches ({'layers x kv heads' if split_heads else 'layers'}), got "
                                      f"{len(dst_k)} and {len(dst_v)}")
            target = self._local_positions(lens)[skip:]
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
                target = positions.to(self.device, torch.int64)
            self._copy(entries, lens, dst_k, dst_v, dst_rows.to(self.device, torch.int64), target, skip, split_heads,
                       heads, layers)
        finally:
            self.resident.unpin(pinned)

    def _local_positions(self, lens) -> torch.Tensor:
        """int64 ``[sum(lens)]``: ``0..n_i-1`` for each chunk."""
        total = sum(lens)
        starts = torch.tensor([0] + lens[:-1], dtype=torch.int64).cumsum(0)
        offs = torch.repeat_interleave(starts, torch.tensor(lens), output_size=total)
        return torch.arange(total, dtype=torch.int64).sub_(offs).to(self.device)

    def _heads(self, heads, split_heads: bool) -> range:
        """The KV heads a gather writes (all, or ``heads`` checked: a non-empty step-1 ``range`` of them)."""
        if heads is None:
            return range(self.num_kv_heads)
        if not split_heads or not isinstance(heads, range) or heads.step != 1 or not len(heads) \
                or heads.start < 0 or heads.stop > self.num_kv_heads:
            raise ChunkStoreError(f"ragattn.ChunkStore.gather_into_: heads must be a non-empty range within "
                                  f"[0, {self.num_kv_heads}) (the store's KV heads) with split_heads=True, got "
                                  f"{heads!r} (split_heads={split_heads})")
        return heads

    def _layers(self, layers) -> range:
        """The layers a gather writes (all, or ``layers`` checked: a non-empty step-1 ``range`` of them)."""
        if layers is None:
            return range(self.num_layers)
        if not is_layer_range(layers, self.num_layers):
            raise ChunkStoreError(f"ragattn.ChunkStore.gather_into_: layers must be a non-empty range within "
                                  f"[0, {self.num_layers}) (the store's layers), got {layers!r}")
        return layers

    def _copy(self, entries, lens, dst_k, dst_v, dst, target, skip: int = 0, split_heads: bool = False,
              heads: range | None = None, layers: range | None = None):
        """Copy the chunks' tokens ``skip..T-1`` to rows ``dst``, keys rotated from the pool's form
        (by their page offset) to ``target`` (int64, each token's RoPE position)."""
        slabs = list({id(s): s for e in entries for s, _, _ in e.parts}.values())
        rs = self.resident
        rot = (rs.inv_freq, rs.rope.rotary_dim, rs.rope.interleaved)
        src_all = (torch.cat([e.rows for e in entries]) if len(entries) > 1 else entries[0].rows)[skip:]
        delta = target - rs.pool_offsets(src_all)
        if len(slabs) == 1:
            _ops.copy_kv_(dst_k, dst_v, *rs.pool.slab_layers(slabs[0], split_heads, heads, layers), src_all, dst,
                          delta, *rot)
            return
        slab_of = torch.cat([torch.full((r,), slabs.index(s), dtype=torch.int64)
                             for e in entries for s, _, r in e.parts])[skip:].to(self.device)
        for i, s in enumerate(slabs):
            sel = (slab_of == i).nonzero()[:, 0]
            if sel.numel() == 0:
                continue
            _ops.copy_kv_(dst_k, dst_v, *rs.pool.slab_layers(s, split_heads, heads, layers), src_all[sel], dst[sel],
                          delta[sel], *rot)

    def _request_cache(self, capacity: int, page_size: int):
        """A fresh batch-1 ``PagedKV``. On the CPU its memory is the buffer of a request cache
        that has died (when no view of it is left anywhere), so that assembling does not
        page-fault a new allocation of the whole cache in on every request; the buffer comes back
        when the returned cache is garbage-collected."""
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
        the final block starts at ``max n_i``); first positions are refused (:mod:`.positions`:
        this cache's slots stand for positions). ``extra_slots``: room for the final block and the
        generated tokens. ``rerotate=False`` skips the rotation (wrong on purpose; for tests).
        """
        scheme = Positions.parse(positions, "ragattn.ChunkStore.assemble", named_only=True).scheme
        _check_chunks_and_extra("assemble", keys, extra_slots)
        if page_size is not None and (isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1):
            raise ChunkStoreError(f"ragattn.ChunkStore.assemble: page_size must be an integer >= 1 or None, "
                                  f"got {page_size!r}")
        entries, pinned = self._pin(keys)
        try:
            lens = [e.length for e in entries]
            starts = Positions("reordered").first_positions(lens)
            total = sum(lens)
            next_pos = Positions(scheme).next_position(lens)
            if next_pos + extra_slots > self.max_positions:
                raise ChunkStoreError(
                    f"ragattn.ChunkStore.assemble: {total} chunk tokens + {extra_slots} extra slots exceed "
                    f"the model's window (max_position_embeddings={self.max_positions})")
            cache = self._request_cache(total + extra_slots, page_size or self.page_size)
            slots = torch.arange(total, device=self.device)
            dst = cache.slot_rows(0, slots)
            if scheme == "reordered":
                pos = slots.to(torch.int32)
            else:
                pos = self._local_positions(lens).to(torch.int32)
            # keys are rotated to their slot's position (rerotate=False: to the chunk-local ones,
            # as if the chunks had not moved)
            self._copy(entries, lens, cache.k, cache.v, dst, pos.long() if rerotate else self._local_positions(lens))
        finally:
            self.resident.unpin(pinned)
        cache.lengths[0] = total
        # composite: the chunks share positions 0.. (a sliding window follows ragattn.kv.window)
        cache.overlapping_positions = scheme == "composite" and sum(n > 0 for n in lens) > 1
        return AssembledRequest(cache, starts, lens, pos, next_pos)
