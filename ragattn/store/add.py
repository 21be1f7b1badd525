"""How chunks enter the store: :meth:`ChunkStore.add` (disk hits loaded, misses prefilled in
packed batches by the model description's ``prefill``) and :meth:`ChunkStore.put` (a derived
entry of a stored chunk, e.g. FusionRAG's fused cache).

Part of :class:`~ragattn.store.ChunkStore` (a mixin over its model description ``spec``, its
entries and its chunk files).
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import torch

from ragattn.store.errors import ChunkStoreError


class _Add:
    """Adding chunks (prefill of the misses) and derived entries."""

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
            if lo < 0 or (self.vocab_size is not None and hi >= self.vocab_size):
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
            else:
                self._note_damaged(k)
            if self._fetch_remote(k):
                continue
            seen.add(k)
            missing.append((k, torch.from_numpy(t)))
        self._prefill(missing)
        return keys

    def _fetch_remote(self, key: str) -> bool:
        """Load ``key`` from the remote tier (verified; written to the disk tier too) if it is there."""
        if self._remote is None:
            return False
        got = self._remote.fetch(key, self.fingerprint, self._layout_dims)
        if got is None:
            return False
        _, tokens, k, v, variant = got
        if self._writable:
            self._write_file(key, tokens, k, v, variant)
            self._bad_files.discard(key)
        self._insert(key, tokens, list(k), list(v), self._writable, variant)
        return True

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
        ids = torch.cat([t for _, t in batch]).to(self.device)
        pos = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lens).cumsum(0)
        if self.description.prefill is None:
            raise ChunkStoreError(f"ragattn.ChunkStore.add: {len(batch)} chunk(s) are not in the store and its "
                                  "model cannot compute them (it serves chunk files only)")
        ks, vs = self.description.prefill(ids, pos, cu.to(self.device))     # per layer [T, Hkv, D]
        if len(ks) != self.num_layers or len(vs) != self.num_layers:
            raise RuntimeError(f"ragattn.ChunkStore: the prefill returned {len(ks)} K and {len(vs)} V layers, "
                               f"expected {self.num_layers}")
        for (key, t), a, b in zip(batch, cu[:-1].tolist(), cu[1:].tolist()):
            k_layers, v_layers = [k[a:b] for k in ks], [v[a:b] for v in vs]
            if self._writable:  # on disk first: a failed write leaves nothing half-added
                self._write_file(key, t, torch.stack(k_layers), torch.stack(v_layers))
                self._bad_files.discard(key)
            if self._remote is not None:
                self._remote.publish(key, t, torch.stack(k_layers), torch.stack(v_layers), self.fingerprint)
            self.stats["recomputed" if key in self._recomputable else "computed"] += 1
            e = self._insert(key, t, k_layers, v_layers, on_disk=self._writable)
            if pinned is not None:
                e.pins += 1
                pinned.append(e)

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
        if vkey in self._entries and self._entries[vkey].pins:   # refused before anything is written
            raise ChunkStoreError(f"ragattn.ChunkStore.put: the entry {vkey!r} (variant {variant!r}) is "
                                  f"{self._pinned_by(self._entries[vkey])}: release it first")
        on_disk = False
        if self._writable:
            self._write_file(vkey, tokens, torch.stack(list(k_layers)), torch.stack(list(v_layers)),
                             (key, variant))
            on_disk = True
        if self._remote is not None:    # published once: an existing copy of the variant stays
            self._remote.publish(vkey, tokens, torch.stack(list(k_layers)), torch.stack(list(v_layers)),
                                 self.fingerprint, (key, variant))
        if vkey in self._entries:
            self._evict(vkey)
        self._insert(vkey, tokens, k_layers, v_layers, on_disk, (key, variant))
        return vkey
