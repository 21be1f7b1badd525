"""Zero-copy requests over the resident set (``ChunkStore.request`` -> :class:`ZeroCopyRequest`):
a position-tagged page table over the chunks' own pool pages, pinned until the request is
released, plus private pool pages for the final block and the answer (docs/chunk-store.md).

    builder = ZeroCopyBuilder(resident, loader.pin)
    with builder.request(keys, positions="reordered", extra_slots=64) as req:
        ...                                   # req.cache: a ragattn.kv.TaggedPagedKV
"""
from __future__ import annotations

import weakref
from typing import Sequence

import torch

from ragattn.kv import TaggedPagedKV
from ragattn.store.copy_out import _check_chunks_and_extra
from ragattn.store.errors import ChunkStoreError
from ragattn.store.page_pool import PagePool
from ragattn.store.positions import Positions


def _release_request(pool: PagePool, pinned: list, private: list, cache_ref, live: dict) -> None:
    """Finalizer of a zero-copy request: its private pages go back to the pool, its chunks are
    unpinned, it leaves the store's ``live`` requests, its cache (when still alive) refuses any later use."""
    live.pop(id(pinned), None)
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
    :class:`~ragattn.kv.TaggedPagedKV` whose page table lists the chunks' shared pool pages
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


class ZeroCopyBuilder:
    """Requests that read the pool of a :class:`~ragattn.store.resident.ResidentSet` in place.
    ``pin(keys) -> (entries, pinned)`` makes the chunks resident and pins them (the loader's
    :meth:`~ragattn.store.loader.Loader.pin`)."""

    def __init__(self, resident, pin):
        self.resident, self._pin = resident, pin

    @torch.no_grad()
    def request(self, keys: Sequence[str], positions="reordered", extra_slots: int = 0) -> ZeroCopyRequest:
        """A zero-copy request over the chunks ``keys`` (in this order): no K/V is copied; the
        request's page table points at the chunks' own (shared, page-local) pool pages with
        their positions, followed by ``ceil(extra_slots / page_size)`` private pages from the pool
        for the final block and the answer. The model then runs on ``req.cache`` through the
        "ragattn" attention (``ragattn_paged=req.cache`` or a ``PagedCache``), keys rotated in the
        kernel; a recompute that writes chunk slots copies their pages first (copy on write).

        ``positions``: "reordered" (chunk i from ``o_i``, consecutive), "composite" (every chunk
        from 0; the final block starts at ``max n_i``), or a sequence of ints: the first position
        of each chunk (any scheme: Block-Attention's offsets, gaps, overlaps); the final block
        starts after the furthest chunk end (:class:`~ragattn.store.positions.Positions`). Release
        with ``req.release()`` or ``with``."""
        _check_chunks_and_extra("request", keys, extra_slots)
        scheme = Positions.parse(positions, "ragattn.ChunkStore.request", count=len(keys))
        rs = self.resident
        p = rs.pool
        entries, pinned = self._pin(keys)
        private: list = []
        rs.live_requests[id(pinned)] = (pinned, private)   # what holds the pool, for its refusals
        try:
            lens = [e.length for e in entries]
            starts = Positions("reordered").first_positions(lens)
            firsts = scheme.first_positions(lens)
            next_pos = scheme.next_position(lens)
            if next_pos + extra_slots > p.max_positions:
                raise ChunkStoreError(
                    f"ragattn.ChunkStore.request: chunks up to position {next_pos} + {extra_slots} extra slots "
                    f"exceed the model's window (max_position_embeddings={p.max_positions})")
            ps = p.page_size

            def alloc_page():
                parts = rs.alloc(ps)
                private.extend(parts)
                slab, pages, _ = parts[0]
                return slab.k_pages, slab.v_pages, pages[0]

            cache = TaggedPagedKV(p.num_layers, p.num_kv_heads, p.head_dim, ps, p.dtype, p.device,
                                  rs.inv_freq, rs.rope.rotary_dim, rs.rope.interleaved, alloc_page)
            for e, first in zip(entries, firsts):
                at = 0
                for slab, pages, r in e.parts:
                    valid = [min(ps, r - i * ps) for i in range(len(pages))]
                    pos = [first + at + i * ps for i in range(len(pages))]
                    cache.add_entries(slab.k_pages, slab.v_pages, pages, pos, valid)
                    at += r
            if extra_slots:
                parts = rs.alloc(extra_slots)
                private.extend(parts)
                for slab, pages, _ in parts:
                    cache.add_private(slab.k_pages, slab.v_pages, pages)
        except BaseException:
            rs.live_requests.pop(id(pinned), None)
            PagePool.free(private)
            rs.unpin(pinned)
            raise
        release = weakref.finalize(cache, _release_request, p, pinned, private, weakref.ref(cache),
                                   rs.live_requests)
        release.atexit = False
        pos = torch.cat([f + torch.arange(n, dtype=torch.int32) for f, n in zip(firsts, lens)])
        return ZeroCopyRequest(cache, starts, lens, pos, next_pos, release, ps * p.row_bytes)
