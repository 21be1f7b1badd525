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
* Worker side, :class:`SharedEntries` per request (:data:`REQUESTS`): the claimed tokens below the
  last block boundary are read from the chunk pages as position-tagged entries; the claim's last
  partial block (under ``block_size`` tokens) is copied into the request's own block.
* Rows a request recomputed (FusionRAG) are copied on write by rows: their fresh K/V go to the
  request's first own blocks, packed (held row ``i`` at slot ``i``), and the chunk pages are read
  as runs around them (``PageTable`` entries with ``entry_start``)::

      chunk page 7 (shared):  | a  b  c  d  e  f  g  h |      request A recomputed c and f:
      A's entries:  (7, from a, slots 0-1) (7, slots 3-4) (7, slots 6-7)   shared, keys page-local
                    (12, slot 0 at c's position) (12, slot 1 at f's)       own block 12: c', f'

* Backend side, :func:`step_tables`: a step that holds such a request attends in two passes, its
  private pages by position (keys rotated) and its chunk pages as entries (keys rotated in the
  kernel, ``inv_freq``), merged exactly (``merge_attention_states``).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ragattn.ops import PageTable


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
        fresh = {k: _cdiv(n, self.block_size) for k, n in zip(keys, lengths) if k not in self._pages}
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


@dataclass(frozen=True)
class SharedEntries:
    """One request's chunk pages as position-tagged entries (worker side): ``private_from``
    (slots below it are read from the entries, the rest from the request's own blocks), and
    int32 ``[E]`` ``pages`` / ``first_pos`` / ``start`` / ``valid`` (the slots ``[start, valid)``
    of each page, slot ``o`` at position ``first_pos + o``). ``held``: the entries of the rows
    below ``private_from`` the request holds in its own blocks (recomputed), the same four
    tensors (keys rotated at their positions, as vLLM's model writes them), or None."""
    private_from: int
    pages: torch.Tensor
    first_pos: torch.Tensor
    valid: torch.Tensor
    start: torch.Tensor | None = None
    held: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, spans: Sequence[tuple[int, int]], chunk_blocks: Sequence[Sequence[int]], block_size: int,
              positions: torch.Tensor | None = None, held: Sequence[int] = (),
              held_blocks: Sequence[int] = ()) -> "SharedEntries":
        """``spans``: the chunks' prompt ranges (tiling ``[0, end)``), ``chunk_blocks`` their pages,
        ``positions`` int64 ``[end]`` each token's RoPE position (None: its index). ``held``: sorted
        prompt indices below ``private_from`` read from the request's own ``held_blocks`` instead
        (index ``held[i]`` at slot ``i % block_size`` of ``held_blocks[i // block_size]``)."""
        end = spans[-1][1]
        private_from = end // block_size * block_size
        held = [int(t) for t in held]
        if any(b <= a for a, b in zip(held, held[1:])) or (held and not 0 <= held[0] <= held[-1] < private_from):
            raise ValueError(f"ragattn.vllm: held rows must be sorted, distinct and below {private_from}")
        if len(held_blocks) * block_size < len(held):
            raise ValueError(f"ragattn.vllm: {len(held)} held rows need {-(-len(held) // block_size)} blocks, "
                             f"got {len(held_blocks)}")
        is_held = set(held)
        pos = (lambda t: t) if positions is None else (lambda t: int(positions[t]))   # noqa: E731
        pages, first, start, valid = [], [], [], []
        for (s, e), blocks in zip(spans, chunk_blocks):
            for i, blk in enumerate(blocks):
                a = s + i * block_size
                n = min(block_size, e - a, private_from - a)
                if n <= 0:
                    break
                run = 0
                for o in range(n + 1):   # the runs of slots [run, o) between held rows
                    if o == n or a + o in is_held:
                        if o > run:
                            pages.append(blk), first.append(pos(a)), start.append(run), valid.append(o)
                        run = o + 1
        as_t = lambda x: torch.tensor(x, dtype=torch.int32)   # noqa: E731
        own = None
        if held:   # held row i at slot i % block_size of held_blocks[i // block_size]: slot 0 at pos - i
            off = torch.arange(len(held), dtype=torch.int32) % block_size
            own = (as_t([held_blocks[i // block_size] for i in range(len(held))]), as_t([pos(t) for t in held]) - off,
                   off, off + 1)
        return cls(private_from, as_t(pages), as_t(first), as_t(valid), as_t(start) if held else None, own)


# Worker process state: the requests served from chunk pages, the batch order of the step being
# built (set by ragattn's worker: the model runner's input batch) and the model's RoPE.
REQUESTS: dict[str, SharedEntries] = {}
BATCH_REQ_IDS: list[Callable[[], Sequence[str]]] = []
ROPE: list = []   # [ragattn.store.model.Rope] of the served model, set by the connector's worker


def step_tables(req_ids: Sequence[str], block_table: torch.Tensor, seq_lens: torch.Tensor,
                block_size: int) -> tuple[PageTable, PageTable] | None:
    """``(private, shared)`` position-tagged tables of a step whose batch rows are ``req_ids``
    (block_table int32 ``[B, max_blocks]``, seq_lens ``[B]``), or None when no row reads chunk
    pages (:func:`entry_tables` of the rows' :data:`REQUESTS` entries)."""
    found = [REQUESTS.get(r) for r in req_ids]
    if not any(found):
        return None
    return entry_tables(found, block_table, seq_lens, block_size)


def entry_tables(found: Sequence[SharedEntries | None], block_table: torch.Tensor, seq_lens: torch.Tensor,
                 block_size: int) -> tuple[PageTable, PageTable]:
    """``(private, shared)`` tables of batch rows reading chunk pages through ``found`` (None: a
    row that does not). Private: each row's own blocks from its ``private_from`` on (by position)
    and its held rows (keys rotated, no RoPE in the kernel); shared: its chunk entries (keys
    page-local)."""
    dev = block_table.device
    b = len(found)
    first_block = torch.tensor([0 if e is None else e.private_from // block_size for e in found], dtype=torch.int64)
    lens = seq_lens[:b].to(torch.int64).cpu()
    n_pages = ((lens + block_size - 1) // block_size - first_block).clamp(min=0)
    rows = torch.repeat_interleave(torch.arange(b), n_pages)
    offset = torch.cumsum(n_pages, 0) - n_pages
    idx = torch.arange(int(n_pages.sum())) - offset[rows] + first_block[rows]
    pos = idx * block_size
    own = (block_table[:b].cpu()[rows, idx].to(torch.int32), pos.to(torch.int32),
           torch.zeros_like(pos, dtype=torch.int32), torch.clamp(lens[rows] - pos, max=block_size).to(torch.int32))
    held = [e.held if e is not None and e.held is not None else None for e in found]
    has_held = any(h is not None for h in held)
    if has_held:   # each row's held entries after its own blocks
        n_held = torch.tensor([0 if h is None else h[0].numel() for h in held], dtype=torch.int64)
        rows = torch.cat([rows, torch.repeat_interleave(torch.arange(b), n_held)])
        order = torch.sort(rows, stable=True).indices
        own = tuple(torch.cat([x] + [h[i] for h in held if h is not None])[order] for i, x in enumerate(own))
        n_pages = n_pages + n_held
    private = PageTable.from_entries(_indptr(n_pages).to(dev), own[0].to(dev), own[1].to(dev), own[3].to(dev),
                                     block_size, own[2].to(dev) if has_held else None)
    empty = torch.zeros(0, dtype=torch.int32)
    runs = any(e is not None and e.start is not None for e in found)
    parts = [(e.pages, e.first_pos, e.valid, e.start if e.start is not None else torch.zeros_like(e.pages))
             if e is not None else (empty,) * 4 for e in found]
    counts = torch.tensor([p[0].numel() for p in parts], dtype=torch.int64)
    cat = [torch.cat([p[i] for p in parts]).to(dev) for i in range(4)]
    shared = PageTable.from_entries(_indptr(counts).to(dev), *cat[:3], block_size, cat[3] if runs else None)
    return private, shared


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])


__all__ = ["ChunkPagePool", "SharedEntries", "REQUESTS", "BATCH_REQ_IDS", "ROPE", "step_tables",
           "entry_tables"]
