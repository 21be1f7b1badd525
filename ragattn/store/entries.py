"""The store's resident chunks: entries in the page pool, their LRU order and pins, and the
page-local form of their keys (see :mod:`ragattn.store.chunk_store`, "Memory").

Part of :class:`~ragattn.store.ChunkStore` (a mixin over its state: ``_pool``, ``_entries``,
``_recomputable``, ``_stale``, ``_layout``, ``stats``, ``rope``/``_inv_freq``); loading and
recomputing a chunk that left memory is :mod:`.chunk_files`' and :mod:`.add`'s.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ragattn import ops as _ops
from ragattn.store.errors import ChunkStoreError
from ragattn.store.page_pool import _Slab


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


class _Entries:
    """The pool's entries: LRU eviction, insertion (keys made page-local), pinning."""

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

    def pool_offsets(self, rows: torch.Tensor) -> torch.Tensor:
        """The pool's one rule for keys: pool row ``r`` (or a chunk's token ``r``: its pages are
        whole but its last) holds its key rotated by its offset in its page, ``r % page_size``."""
        return rows % self.page_size

    def _evict_one(self) -> bool:
        for key, e in self._entries.items():
            if e.pins == 0:
                self._evict(key)
                return True
        return False

    def _alloc(self, n: int):
        """Pool pages for ``n`` rows (:meth:`PagePool.alloc`), evicting unpinned chunks as needed."""
        return self._pool.alloc(n, self._evict_one, self._why_full)

    def _why_full(self, need: int) -> str | None:
        """Why ``need`` more pages do not fit when nothing can be evicted: live zero-copy requests
        hold the pages (their pinned chunks and private pages), unless the pages pinned by the
        running call alone leave no room (None: the budget is too small for one request)."""
        live = list(self._live_requests.values())
        held = {id(e): e for pinned, _ in live for e in pinned}
        req_pages = sum(len(p) for e in held.values() for _, p, _ in e.parts)
        req_pages += sum(len(p) for _, private in live for _, p, _ in private)
        counts = [sum(x is e for pinned, _ in live for x in pinned) for e in self._entries.values()]
        call_pages = sum(len(p) for e, c in zip(self._entries.values(), counts) if e.pins > c for _, p, _ in e.parts)
        budget = self._pool.budget_pages
        if req_pages == 0 or call_pages + need > budget:
            return None
        return (f"ragattn.ChunkStore: memory budget ({self.memory_budget} bytes) too small beside the live "
                f"zero-copy requests, not for this call: {len(live)} live zero-copy request(s) hold {req_pages} "
                f"of its {budget} pages (their chunks pinned, their private pages), {need} more are needed: "
                "release them (req.release()) or raise memory_budget")

    def _pinned_by(self, e: _Entry) -> str:
        """Who pins ``e``, for an error: live zero-copy requests, or the running gather."""
        n = sum(any(x is e for x in pinned) for pinned, _ in self._live_requests.values())
        return f"held by {n} live zero-copy request(s)" if n else "in use by a running gather"

    def _evict(self, key: str) -> None:
        e = self._entries.pop(key)
        self._pool.free(e.parts)
        self.stats["evicted"] += 1
        if e.variant is None:   # on disk or not: a file may go bad or away, the tokens recompute it
            self._recomputable[key] = e.tokens
        self._layout += 1

    def _insert(self, key, tokens, k_layers, v_layers, on_disk: bool, variant=None) -> _Entry:
        """Copy per-layer ``[n, Hkv, D]`` K/V (any device/dtype-compatible) into fresh pages."""
        n = int(tokens.numel())
        parts = self._alloc(n)
        rows = self._pool.rows_of(parts)
        self._pool.write(parts, rows, k_layers, v_layers)
        self._to_page_local_(parts, rows)   # the pool's form: rotated from 0..n-1 to page offsets
        e = _Entry(tokens.to("cpu", torch.int64), parts, rows, on_disk, variant)
        self._entries[key] = e
        self._recomputable.pop(key, None)
        self._layout += 1
        return e

    def _to_page_local_(self, parts, rows: torch.Tensor) -> None:
        """Rotate the keys of a chunk (``parts``/``rows`` of its pages, token order), computed at
        ``0..n-1``, in place to the pool's form: a pool row holds its key rotated by its offset in
        its page (``row % page_size``; a chunk's pages are whole but its last, so token ``j`` is
        rotated by ``j % page_size``), valid wherever a request places the page (the attention
        kernel rotates it by the page's first position more). One ``rerotate_keys_`` per slab
        (fp32 rotation)."""
        at = 0
        for slab, _, r in parts:
            sel = rows[at: at + r]
            delta = self.pool_offsets(sel) - torch.arange(at, at + r, dtype=torch.int64, device=self.device)
            _ops.rerotate_keys_(slab.k, sel, delta, self._inv_freq, self.rope.rotary_dim, self.rope.interleaved)
            at += r


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
            if key not in self._entries and key not in self._recomputable:
                self._fetch_remote(key)     # a fleet's shared tier (no-op without one)
            if key not in self._entries and key in self._recomputable:
                self._note_damaged(key)
                self._prefill([(key, self._recomputable[key])])
            e = self._entries.get(key)
            if e is None:
                if key in self._stale:
                    raise ChunkStoreError(
                        f"ragattn.ChunkStore: chunk {key!r} was computed with the model's earlier weights "
                        "(they changed since): add() its tokens again for its key under the current weights")
                self._refuse_damaged(key)
                raise ChunkStoreError(f"ragattn.ChunkStore: no chunk with key {key!r} in the store")
        else:
            self._entries.move_to_end(key)
        return e


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
                    self._note_damaged(k)
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

