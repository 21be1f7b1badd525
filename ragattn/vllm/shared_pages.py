"""Shared chunk pages inside vLLM: each chunk's K/V lives once in vLLM's own KV cache and every
request that uses it reads that copy (``kv_connector_extra_config: {"shared_pages": true}`` on a
server with ragattn's attention backend; Block-Attention, TurboRAG and FusionRAG requests).

::

    request A: | chunk 1 | chunk 2 |  question A ...      chunk pages, one copy (keys page-local):
    request B: | chunk 2 | chunk 1 |  question B ...        chunk 1: blocks 7 8   chunk 2: blocks 3 9
                                                          private blocks (keys rotated by vLLM):
    A's blocks: | null | null | 12 | 13 |                   A: 12 13 (chunk 2's tail, then question A)
    B's blocks: | null | null | 14 | 15 |                   B: 14 15

* Scheduler side, :class:`ChunkPagePool`: a chunk's pages come from vLLM's ``BlockPool`` once
  (``get_new_blocks``), are held while any request uses them and freed least recently used when
  the scheduler runs short, so vLLM's usage counts them. A request first gets blocks for its whole
  prompt as usual (vLLM's admission counts them); once its worker has written or found its chunk
  pages, :meth:`ChunkPagePool.give_back` replaces the request's blocks that hold only claimed
  tokens by the null block and frees them, as vLLM does for tokens outside a sliding window.
  Until then (and for good if the chunks cannot be loaded) the request is a plain copy request.
* Worker side: each request's chunk pages as :class:`ragattn.kv.SharedEntries` (in the worker's
  :class:`ragattn.vllm.worker_state.WorkerState`): the claimed tokens below the last block boundary
  are read from the chunk pages as position-tagged entries; the claim's last partial block (under
  ``block_size`` tokens) is copied into the request's own block. Rows a request recomputed
  (FusionRAG) are held in its own first blocks (copy on write by rows, :mod:`ragattn.kv.shared_entries`).
* Backend side: a step that holds such a request attends in two passes (``ragattn.kv.PassStep``),
  its private pages by position and its chunk pages as entries, merged exactly by LSE.

This module holds the scheduler side::

    pool = ChunkPagePool(block_pool, block_size)
    blocks = pool.acquire(req_id, keys, lengths)      # per chunk its block ids, or None
    pool.give_back(kv_cache_manager, req_id, block_ids, first)
    pool.release(req_id); pool.evict(n); pool.drop(key); pool.take_evicted()
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from ragattn.ops.page_table import num_pages


@dataclass
class _Pages:
    blocks: list          # vLLM KVCacheBlocks, one reference held by the pool
    users: set = field(default_factory=set)


class ChunkPagePool:
    """Chunk pages in vLLM's ``BlockPool`` (scheduler side). ``acquire`` before a request's load,
    ``release`` when it finishes; idle pages stay until :meth:`evict` needs their blocks."""

    def __init__(self, block_pool, block_size: int):
        self.block_pool, self.block_size = block_pool, int(block_size)
        self._pages: OrderedDict[str, _Pages] = OrderedDict()     # least recently used first
        self._by_request: dict[str, tuple[str, ...]] = {}
        self._evicted: list[str] = []
        self._dropped: list[_Pages] = []    # pages no new request gets, freed when their last user finishes

    def blocks_held(self) -> int:
        """Blocks the pool holds (in use or idle)."""
        return sum(len(p.blocks) for p in (*self._pages.values(), *self._dropped))

    def acquire(self, req_id: str, keys: Sequence[str], lengths: Sequence[int]) -> list[list[int]] | None:
        """Block ids of each chunk's pages (``ceil(length / block_size)`` each), taken from the pool
        where not held yet (idle pages evicted for room); None, holding nothing, if they do not fit."""
        self.release(req_id)
        fresh = {k: num_pages(n, self.block_size) for k, n in zip(keys, lengths) if k not in self._pages}
        need = sum(fresh.values())
        if need > self.block_pool.get_num_free_blocks():
            self.evict(need - self.block_pool.get_num_free_blocks(), keep=set(keys))
            if need > self.block_pool.get_num_free_blocks():
                return None
        out = []
        for key in keys:
            pages = self._pages.get(key)
            if pages is None:
                pages = self._pages[key] = _Pages(self.block_pool.get_new_blocks(fresh[key]))
            pages.users.add(req_id)
            self._pages.move_to_end(key)
            out.append([b.block_id for b in pages.blocks])
        self._by_request[req_id] = tuple(keys)
        return out

    def release(self, req_id: str) -> None:
        for key in self._by_request.pop(req_id, ()):
            pages = self._pages.get(key)
            if pages is not None:
                pages.users.discard(req_id)
        for pages in [p for p in self._dropped if req_id in p.users]:
            pages.users.discard(req_id)
            if not pages.users:
                self._dropped.remove(pages)
                self.block_pool.free_blocks(pages.blocks)

    def evict(self, num_blocks: int, keep: set | None = None) -> int:
        """Frees idle pages, least recently used first, until ``num_blocks`` are freed; returns how
        many were."""
        freed = 0
        for key in [k for k, p in self._pages.items() if not p.users and k not in (keep or ())]:
            if freed >= num_blocks:
                break
            freed += self._free(key)
        return freed

    def drop(self, key: str) -> None:
        """A chunk whose pages could not be written: no request gets them again, and they are freed
        once no request holds them (a request scheduled before the failure was reported may have
        written and be reading them: the file restored in between)."""
        pages = self._pages.get(key)
        if pages is None:
            return
        if not pages.users:
            self._free(key)
            return
        del self._pages[key]
        self._dropped.append(pages)
        self._evicted.append(key)

    def _free(self, key: str) -> int:
        pages = self._pages.pop(key)
        self.block_pool.free_blocks(pages.blocks)
        self._evicted.append(key)
        return len(pages.blocks)

    def take_evicted(self) -> list[str]:
        """Keys whose pages were freed since the last call (the worker forgets it wrote them)."""
        out, self._evicted = self._evicted, []
        return out

    def give_back(self, kv_cache_manager, req_id: str, block_ids: Sequence[int], first: int = 0) -> int:
        """Replaces the request's blocks ``block_ids`` from its block ``first`` on (those holding
        claimed tokens only; the ones before hold its recomputed rows) by the null block and frees
        them; nothing if the request no longer holds exactly those (finished, or preempted and
        allocated again). Returns the number of blocks freed."""
        (manager,) = kv_cache_manager.coordinator.single_type_managers
        blocks = manager.req_to_blocks.get(req_id)
        n = len(block_ids)
        if not blocks or n == 0 or [b.block_id for b in blocks[first:first + n]] != list(block_ids):
            return 0
        freed = [b for b in blocks[first:first + n] if not b.is_null]
        blocks[first:first + n] = [self.block_pool.null_block] * n
        self.block_pool.free_blocks(freed)
        return len(freed)


__all__ = ["ChunkPagePool"]
