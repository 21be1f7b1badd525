"""The chunk store's in-memory pool: a byte budget of K/V, in slabs cut into pages, and its
allocator (see :mod:`ragattn.store.chunk_store`, "Memory")."""
from __future__ import annotations

import os
from typing import Callable

import torch

from ragattn.ops.page_table import num_pages, page_rows
from ragattn.store.errors import ChunkStoreError

DEFAULT_BUDGET_FRACTION = 0.25   # of the device's available memory, when no budget is given
_FIRST_SLAB_BYTES = 64 << 20    # first slab at most (and two model windows, and the budget's
_FIRST_SLAB_PAGES = 16          # quarter), at least 16 pages: a typical request spans one slab
# On the CPU a slab's pages take memory when first written (torch.empty maps them lazily), so the
# first slab may be larger there: a request's chunks, its private pages and its copies on write
# then share one slab, and its attention is one kernel call per layer, not one per slab merged by
# LSE.
_FIRST_SLAB_BYTES_CPU = 1 << 30


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


class _Slab:
    """A piece of the pool: per layer ``[pages * page_size, Hkv, D]`` K and V, and its free pages."""

    def __init__(self, pool: "PagePool", pages: int):
        rows = pages * pool.page_size
        shape = (rows, pool.num_kv_heads, pool.head_dim)
        self.k = [torch.empty(shape, dtype=pool.dtype, device=pool.device) for _ in range(pool.num_layers)]
        self.v = [torch.empty(shape, dtype=pool.dtype, device=pool.device) for _ in range(pool.num_layers)]
        self.pages = pages
        self.free = list(range(pages - 1, -1, -1))  # popped from the end: low pages first
        # the same memory as [pages, page_size, Hkv, D] per layer: what zero-copy requests read
        # (one object per slab, so that a request knows its pages' tensors by identity)
        page_shape = (pages, pool.page_size, pool.num_kv_heads, pool.head_dim)
        self.k_pages = [t.view(page_shape) for t in self.k]
        self.v_pages = [t.view(page_shape) for t in self.v]


class PagePool:
    """Slabs of per-layer K/V pages within ``memory_budget`` bytes.

    It grows by adding a slab (never by copying into a larger one: no transient 2x peak); when
    the budget is reached :meth:`alloc` asks its caller to evict (``evict_one``)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, page_size: int, memory_budget: int, max_positions: int):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device, self.page_size = dtype, device, page_size
        self.max_positions = max_positions
        self.row_bytes = 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
        if memory_budget < self.row_bytes * page_size:
            raise ChunkStoreError(f"ragattn.ChunkStore: memory_budget={memory_budget} bytes is below one page "
                                  f"({page_size} rows x {self.row_bytes} bytes)")
        self.memory_budget = memory_budget
        self.budget_pages = memory_budget // (self.row_bytes * page_size)
        self.slabs: list[_Slab] = []

    @property
    def pool_rows(self) -> int:
        return sum(s.pages for s in self.slabs) * self.page_size

    @property
    def pool_bytes(self) -> int:
        return self.pool_rows * self.row_bytes

    def alloc(self, n: int, evict_one: Callable[[], bool],
              explain: Callable[[int], str | None] | None = None) -> list[tuple[_Slab, list[int], int]]:
        """Pages for ``n`` rows: ``[(slab, pages, rows)]``, the parts in row order (part ``i``
        holds ``rows`` rows on ``pages`` of ``slab``). One slab when one has the room (free pages,
        else a new slab within the budget, else after releasing empty slabs); else the free pages
        of several slabs and the budget left (pages, not slabs: pinned chunks that fragment the
        slabs never make a request that fits the budget fail); else ``evict_one()`` and again
        (False: nothing left to evict: refused with ``explain(pages needed)``, the caller's
        account of what holds the pool, or when it has none: the request does not fit)."""
        m = num_pages(n, self.page_size)
        if m > self.budget_pages:
            raise ChunkStoreError(
                f"ragattn.ChunkStore: a chunk of {n} tokens needs {m * self.page_size * self.row_bytes} "
                f"bytes, more than the memory budget ({self.memory_budget} bytes)")
        while True:
            for s in self.slabs:
                if len(s.free) >= m:
                    return self._take([(s, m)], n)
            cap = sum(s.pages for s in self.slabs)
            room = self.budget_pages - cap
            if room >= m:
                self.slabs.append(_Slab(self, self._grow(m, cap, room)))
                continue
            empty = [s for s in self.slabs if len(s.free) == s.pages]
            if empty and room + sum(s.pages for s in empty) >= m:
                self.slabs = [s for s in self.slabs if len(s.free) != s.pages]
                continue
            free = sum(len(s.free) for s in self.slabs)
            if free + room >= m:   # spread: the fullest free lists first (few parts)
                take, need = [], m
                for s in sorted(self.slabs, key=lambda s: -len(s.free)):
                    if need and s.free:
                        take.append((s, min(need, len(s.free))))
                        need -= take[-1][1]
                if need:
                    self.slabs.append(_Slab(self, self._grow(need, cap, room)))
                    take.append((self.slabs[-1], need))
                return self._take(take, n)
            if not evict_one():
                why = explain(m) if explain is not None else None
                raise ChunkStoreError(why or
                    f"ragattn.ChunkStore: memory budget ({self.memory_budget} bytes) too small: the "
                    f"chunks one request uses do not fit in it together")

    def _grow(self, m: int, cap: int, room: int) -> int:
        """Pages of a new slab for ``m`` pages: geometric growth (few slabs), at most a quarter of
        the budget at once, within ``room``."""
        first_bytes = _FIRST_SLAB_BYTES_CPU if self.device.type == "cpu" else _FIRST_SLAB_BYTES
        first = max(_FIRST_SLAB_PAGES, min(first_bytes // (self.page_size * self.row_bytes),
                                           num_pages(2 * self.max_positions, self.page_size)))
        return min(max(m, cap, first), max(m, self.budget_pages // 4), room)

    def _take(self, take, n: int) -> list[tuple[_Slab, list[int], int]]:
        parts, left = [], n
        for s, m in take:
            pages = s.free[-m:][::-1]
            del s.free[-m:]
            rows = min(left, m * self.page_size)
            parts.append((s, pages, rows))
            left -= rows
        return parts

    def rows_of(self, parts) -> torch.Tensor:
        """int64 ``[n]`` on the pool's device: each row's index in its part's slab, in order."""
        rows = [page_rows(pages, self.page_size)[:r] for _, pages, r in parts]
        return (rows[0] if len(rows) == 1 else torch.cat(rows)).to(self.device)

    def write(self, parts, rows: torch.Tensor, k_layers, v_layers) -> None:
        """Per-layer ``[n, Hkv, D]`` K/V (any device, a dtype that converts) into ``rows`` of the parts."""
        at = 0
        for slab, _, r in parts:
            sel = rows[at: at + r]
            for dst, src in ((slab.k, k_layers), (slab.v, v_layers)):
                for l in range(self.num_layers):
                    dst[l].index_copy_(0, sel, src[l][at: at + r].to(self.device, self.dtype))
            at += r

    @staticmethod
    def read(parts, rows: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer ``[n, Hkv, D]`` copies of ``rows`` of the parts."""
        if len(parts) == 1:
            slab = parts[0][0]
            return [p.index_select(0, rows) for p in slab.k], [p.index_select(0, rows) for p in slab.v]
        out = []
        for which in ("k", "v"):
            layers, a = [], 0
            for slab, _, r in parts:
                layers.append([p.index_select(0, rows[a: a + r]) for p in getattr(slab, which)])
                a += r
            out.append([torch.cat(per) for per in zip(*layers)])
        return out[0], out[1]

    def slab_layers(self, slab: _Slab, split_heads: bool, heads: range | None = None, layers: range | None = None):
        """The slab's per-layer K and V, of the layers ``layers`` only (default all); ``split_heads``:
        per (layer, head) ``[rows, 1, D]`` views instead, of the KV heads ``heads`` only (default
        all), layer-major."""
        ls = range(self.num_layers) if layers is None else layers
        ks, vs = [slab.k[l] for l in ls], [slab.v[l] for l in ls]
        if not split_heads:
            return ks, vs
        hs = range(self.num_kv_heads) if heads is None else heads
        return ([k[:, h:h + 1] for k in ks for h in hs], [v[:, h:h + 1] for v in vs for h in hs])

    def copy_out(self, device: torch.device, pin_memory: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[L, pool_rows, Hkv, D]``: every slab in order, on ``device``."""
        shape = (self.num_layers, self.pool_rows, self.num_kv_heads, self.head_dim)
        out = []
        for which in ("k", "v"):
            t = torch.empty(shape, dtype=self.dtype, device=device, pin_memory=pin_memory)
            r = 0
            for s in self.slabs:
                layers = getattr(s, which)
                for l in range(self.num_layers):
                    t[l, r: r + layers[l].shape[0]].copy_(layers[l])
                r += layers[0].shape[0]
            out.append(t)
        return out[0], out[1]

    def copy_in(self, k: torch.Tensor, v: torch.Tensor, non_blocking: bool) -> None:
        """The reverse of :meth:`copy_out` (shapes checked by the caller)."""
        for which, src in (("k", k), ("v", v)):
            r = 0
            for s in self.slabs:
                layers = getattr(s, which)
                n = layers[0].shape[0]
                for l in range(self.num_layers):
                    layers[l].copy_(src[l, r: r + n], non_blocking=non_blocking)
                r += n

    @staticmethod
    def free(parts) -> None:
        """Give the pages of ``parts`` back."""
        for slab, pages, _ in parts:
            slab.free.extend(pages)
