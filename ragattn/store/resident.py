"""The store's resident set: the chunks in the page pool, their LRU order and pins, and the
page-local form of their keys (docs/chunk-store.md, "Memory").

    resident = ResidentSet(pool, rope, stats, on_evict)
    e = resident.insert(key, tokens, k_layers, v_layers, on_disk)   # keys made page-local
    parts = resident.alloc(n)            # pool pages, the least recently used unpinned entries evicted
    k, v = resident.read_local(e)        # copies, keys rotated to the chunk's 0..n-1

What is not resident (disk, remote, recompute) is the loader's (:mod:`.loader`).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ragattn import ops as _ops
from ragattn.ops.page_table import page_offset
from ragattn.store.errors import ChunkStoreError
from ragattn.store.page_pool import PagePool, _Slab


@dataclass(eq=False)
class Entry:
    """A resident chunk (or derived entry)."""
    tokens: torch.Tensor          # int64 [n], CPU
    parts: list[tuple[_Slab, list[int], int]]   # (slab, pages, rows) in token order; usually one
    rows: torch.Tensor            # int64 [n]: each token's row in its part's slab, on the store's device
    on_disk: bool                 # a verified file of it is in the store's directory
    variant: tuple[str, str] | None = None   # (chunk key, variant name) of a derived entry
    pins: int = field(default=0)

    @property
    def length(self) -> int:
        return int(self.tokens.numel())


class ResidentSet:
    """Entries over a :class:`PagePool`: insertion (keys made page-local), LRU eviction of
    unpinned entries, pins, the live zero-copy requests that hold pages, and the pool's layout
    counter (bumped whenever pool rows change meaning: insert, evict, clear).

    ``on_evict(key, entry)``: called when the LRU evicts an entry (the loader keeps the tokens of
    an evicted chunk to recompute it); ``stats``: the store's counters (``evicted``)."""

    def __init__(self, pool: PagePool, rope, stats: dict,
                 on_evict: Optional[Callable[[str, Entry], None]] = None):
        self.pool = pool
        self.page_size, self.device = pool.page_size, pool.device
        self.stats = stats
        self.on_evict = on_evict
        self.entries: "OrderedDict[str, Entry]" = OrderedDict()   # LRU order: oldest first
        # id(pinned) -> (pinned entries, private parts) of each live zero-copy request
        self.live_requests: dict[int, tuple[list, list]] = {}
        self.layout = 0
        self.pooled_layout = None
        self.set_rope(rope)

    def set_rope(self, rope) -> None:
        self.rope = rope
        self.inv_freq = rope.inv_freq.to(self.device)

    # ----- sizes ------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return sum(e.length for e in self.entries.values())

    def pool_offsets(self, rows: torch.Tensor) -> torch.Tensor:
        """The pool's one rule for keys: pool row ``r`` (or a chunk's token ``r``: its pages are
        whole but its last) holds its key rotated by its offset in its page, ``r % page_size``."""
        return page_offset(rows, self.page_size)

    # ----- pages and eviction -------------------------------------------------------------------
    def alloc(self, n: int):
        """Pool pages for ``n`` rows (:meth:`PagePool.alloc`), evicting unpinned entries as needed."""
        return self.pool.alloc(n, self._evict_one, self._why_full)

    def _evict_one(self) -> bool:
        for key, e in self.entries.items():
            if e.pins == 0:
                self.evict(key)
                return True
        return False

    def evict(self, key: str) -> None:
        e = self.entries.pop(key)
        self.pool.free(e.parts)
        self.stats["evicted"] += 1
        if self.on_evict is not None:
            self.on_evict(key, e)
        self.layout += 1

    def clear(self) -> list[str]:
        """Drop every entry (the model's weights changed); returns their keys."""
        keys = list(self.entries)
        for key in keys:
            self.pool.free(self.entries.pop(key).parts)
        self.layout += 1
        return keys

    def _why_full(self, need: int) -> str | None:
        """Why ``need`` more pages do not fit when nothing can be evicted: live zero-copy requests
        hold the pages (their pinned chunks and private pages), unless the pages pinned by the
        running call alone leave no room (None: the budget is too small for one request)."""
        live = list(self.live_requests.values())
        held = {id(e): e for pinned, _ in live for e in pinned}
        req_pages = sum(len(p) for e in held.values() for _, p, _ in e.parts)
        req_pages += sum(len(p) for _, private in live for _, p, _ in private)
        counts = [sum(x is e for pinned, _ in live for x in pinned) for e in self.entries.values()]
        call_pages = sum(len(p) for e, c in zip(self.entries.values(), counts) if e.pins > c for _, p, _ in e.parts)
        budget = self.pool.budget_pages
        if req_pages == 0 or call_pages + need > budget:
            return None
        return (f"ragattn.ChunkStore: memory budget ({self.pool.memory_budget} bytes) too small beside the live "
                f"zero-copy requests, not for this call: {len(live)} live zero-copy request(s) hold {req_pages} "
                f"of its {budget} pages (their chunks pinned, their private pages), {need} more are needed: "
                "release them (req.release()) or raise memory_budget")

    # ----- pins -------------------------------------------------------------------------------
    def pinned_by(self, e: Entry) -> str:
        """Who pins ``e``, for an error: live zero-copy requests, or the running gather."""
        n = sum(any(x is e for x in pinned) for pinned, _ in self.live_requests.values())
        return f"held by {n} live zero-copy request(s)" if n else "in use by a running gather"

    def any_pinned(self) -> bool:
        return any(e.pins for e in self.entries.values())

    @staticmethod
    def unpin(pinned) -> None:
        for e in pinned:
            e.pins -= 1

    # ----- entries in and out ---------------------------------------------------------------------
    def insert(self, key, tokens, k_layers, v_layers, on_disk: bool, variant=None) -> Entry:
        """Copy per-layer ``[n, Hkv, D]`` K/V (keys at ``0..n-1``, any device/dtype-compatible) into
        fresh pages, keys made page-local; the entry is the most recently used."""
        n = int(tokens.numel())
        parts = self.alloc(n)
        rows = self.pool.rows_of(parts)
        self.pool.write(parts, rows, k_layers, v_layers)
        self._to_page_local_(parts, rows)
        e = Entry(tokens.to("cpu", torch.int64), parts, rows, on_disk, variant)
        self.entries[key] = e
        self.layout += 1
        return e

    def _to_page_local_(self, parts, rows: torch.Tensor) -> None:
        """Rotate the keys of a chunk (``parts``/``rows`` of its pages, token order), computed at
        ``0..n-1``, in place to the pool's form: a pool row holds its key rotated by its offset in
        its page (a chunk's pages are whole but its last, so token ``j`` is rotated by ``j %
        page_size``), valid wherever a request places the page (the attention kernel rotates it by
        the page's first position more). One ``rerotate_keys_`` per slab (fp32 rotation)."""
        at = 0
        for slab, _, r in parts:
            sel = rows[at: at + r]
            delta = self.pool_offsets(sel) - torch.arange(at, at + r, dtype=torch.int64, device=self.device)
            _ops.rerotate_keys_(slab.k, sel, delta, self.inv_freq, self.rope.rotary_dim, self.rope.interleaved)
            at += r

    def read_local(self, e: Entry) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer ``[n, Hkv, D]`` copies of an entry, keys rotated to its local positions
        ``0..n-1`` (the form of chunk files and of ``ChunkStore.get_kv``)."""
        k, v = self.pool.read(e.parts, e.rows)
        n = e.length
        if n:
            # from the pool's page offsets to 0..n-1
            delta = torch.arange(n, device=self.device) - self.pool_offsets(e.rows.to(self.device))
            _ops.rerotate_keys_(k, torch.arange(n, device=self.device), delta, self.inv_freq,
                                self.rope.rotary_dim, self.rope.interleaved)
        return k, v

    # ----- the whole pool ---------------------------------------------------------------------------
    def pooled_kv(self, device: str | torch.device = "cpu", pin_memory: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """``ChunkStore.pooled_kv``: the whole pool copied out (keys in the pool's form)."""
        device = torch.device(device)
        if pin_memory and device.type != "cpu":
            raise ChunkStoreError(f"ragattn.ChunkStore.pooled_kv: pin_memory needs device 'cpu', "
                                  f"got {device}")
        if pin_memory and not torch.cuda.is_available():
            raise ChunkStoreError("ragattn.ChunkStore.pooled_kv: pin_memory=True needs CUDA (page-locked "
                                  "host memory is for asynchronous copies to a GPU); none is available")
        out = self.pool.copy_out(device, pin_memory)
        self.pooled_layout = self.layout
        return out

    def load_pooled_kv_(self, k: torch.Tensor, v: torch.Tensor, non_blocking: bool = False) -> None:
        """``ChunkStore.load_pooled_kv_``: the pool overwritten with a copy of :meth:`pooled_kv`
        taken since its last change."""
        p = self.pool
        want = (p.num_layers, p.pool_rows, p.num_kv_heads, p.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise ChunkStoreError(f"ragattn.ChunkStore.load_pooled_kv_: {name} must be a tensor, "
                                      f"got {type(t).__name__}")
            if tuple(t.shape) != want:
                raise ChunkStoreError(f"ragattn.ChunkStore.load_pooled_kv_: {name} has shape "
                                      f"{tuple(t.shape)}, expected {want} ([L, pool_rows, Hkv, D])")
            if t.dtype != p.dtype:
                raise ChunkStoreError(f"ragattn.ChunkStore.load_pooled_kv_: {name} has dtype {t.dtype}, "
                                      f"expected {p.dtype}")
        if self.any_pinned():
            # a live zero-copy request's private pages (its question and answer) are pool pages too
            raise ChunkStoreError("ragattn.ChunkStore.load_pooled_kv_: live requests hold pages of the pool "
                                  "(release them first): the copy would overwrite their private pages")
        if self.pooled_layout != self.layout:
            raise ChunkStoreError("ragattn.ChunkStore.load_pooled_kv_: the pool changed (chunks added, "
                                  "evicted or overwritten) since pooled_kv() was taken: the copy is stale")
        p.copy_in(k, v, non_blocking)
