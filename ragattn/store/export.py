"""What leaves the store as plain tensors: a chunk's K/V at its local positions
(:meth:`ChunkStore.get_kv`, :meth:`ChunkStore.kv`; the pool holds keys page-local) and the whole
pool copied out and back (:meth:`ChunkStore.pooled_kv`, :meth:`ChunkStore.load_pooled_kv_`).

Part of :class:`~ragattn.store.ChunkStore` (a mixin over its pool and entries).
"""
from __future__ import annotations

import torch

from ragattn import ops as _ops
from ragattn.store.entries import _Entry
from ragattn.store.errors import ChunkStoreError


class _Export:
    """Copies of chunks (keys rotated to 0..n-1) and of the pool."""

    def _read_local(self, e: _Entry) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer ``[n, Hkv, D]`` copies of an entry, keys rotated to its local positions
        ``0..n-1`` (the form of chunk files and of :meth:`get_kv`)."""
        k, v = self._pool.read(e.parts, e.rows)
        n = e.length
        if n:
            # from the pool's page offsets to 0..n-1
            delta = torch.arange(n, device=self.device) - self.pool_offsets(e.rows.to(self.device))
            _ops.rerotate_keys_(k, torch.arange(n, device=self.device), delta, self._inv_freq, self.rope.rotary_dim, self.rope.interleaved)
        return k, v

    def pooled_kv(self, device: str | torch.device = "cpu", pin_memory: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the whole in-memory pool, e.g. to keep the chunk KV in host memory.

        Returns K, V: ``[L, pool_rows, Hkv, D]`` each (every allocated pool row, the slabs in
        order; rows of free pages hold garbage), in the model's dtype, on ``device``;
        ``pin_memory=True`` (CPU ``device`` only, needs CUDA) allocates them in page-locked
        memory so that :meth:`load_pooled_kv_` can copy them to the GPU asynchronously. The copy
        is only meaningful to this store while no chunk is added, evicted or overwritten.
        Keys are in the pool's form: each rotated by its row's offset in its page (``row % page_size``;
        :meth:`get_kv` rotates them to their local positions)."""
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

    def get_kv(self, key: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K, V of a stored chunk: per layer ``[n, Hkv, D]`` copies, keys rotated to the chunk's
        local positions ``0..n-1`` (the pool holds them page-local: rotated here, in fp32)."""
        self._sync()
        e = self._get(key)
        return self._read_local(e)

    def kv(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of a stored chunk: ``[L, n, Hkv, D]`` each (copies; keys at local positions)."""
        k, v = self.get_kv(key)
        return torch.stack(k), torch.stack(v)
