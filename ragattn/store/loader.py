"""The store's loader: the whole miss policy, and how chunks enter the resident set.

    loader = Loader(spec, resident, disk, remote, stats, max_batch_tokens)
    keys = loader.add(chunks)         # memory hits, else disk, else remote, else one packed prefill
    e = loader.get(key)               # resident, loaded or recomputed (memory, disk, remote, tokens)
    entries, pinned = loader.pin(keys)   # every key resident and pinned (release: ResidentSet.unpin)

A chunk that is not resident is, in one order for ``get``, ``pin`` and ``add`` (:meth:`Loader._from_tiers`):
loaded from its verified file in the store's directory; else fetched from the remote tier
(verified, written to the disk tier too); else recomputed from its tokens in packed prefills (the
chunks ``add`` was given, the evicted chunks whose tokens the store keeps); else refused, naming
why (earlier weights, a damaged file, an unknown key). A derived entry found nowhere is gone. A bad
file (truncated, corrupt) is counted and replaced by the recomputation, or removed when it cannot
be recomputed (docs/chunk-store.md).
"""
from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ragattn.store.cost import TIERS_FIRST, TierCosts
from ragattn.store.disk_tier import DiskTier, is_chunk_file, read_chunk_file, write_chunk_file
from ragattn.store.errors import ChunkStoreError
from ragattn.store.fingerprint import variant_key
from ragattn.store.model import ChunkModel
from ragattn.store.resident import Entry, ResidentSet

_KEY = re.compile(r"^[0-9a-f]{40}$")


class Loader:
    """Everything between a key and its resident entry. ``spec``: the model description
    (``fingerprint``, dimensions, ``prefill``; replaced by :meth:`weights_changed`); ``disk``: a
    :class:`DiskTier` or None; ``remote``: a :class:`RemoteTier` or None; ``stats``: the store's
    counters (``computed``, ``recomputed``, ``loaded``, ``bad_files``, ``recompute_chosen``, and the
    seconds spent per source: ``disk_s``, ``remote_s``, ``recompute_s``); ``costs``: a
    :class:`TierCosts` (default :data:`TIERS_FIRST`: a tier read whenever the chunk is in a tier),
    by which a chunk whose tokens are known is recomputed instead of read when that is cheaper."""

    def __init__(self, spec: ChunkModel, resident: ResidentSet, disk: DiskTier | None, remote, stats: dict,
                 max_batch_tokens: int, costs: TierCosts | None = None):
        self.spec, self.resident, self.disk, self.remote = spec, resident, disk, remote
        self.stats, self.max_batch_tokens = stats, max_batch_tokens
        if costs is not None and not isinstance(costs, TierCosts):
            raise ChunkStoreError(f"ragattn.ChunkStore: costs must be a ragattn.store.TierCosts, got {costs!r}")
        self.costs = TIERS_FIRST if costs is None else costs
        for name in ("recompute_chosen", "disk_s", "remote_s", "recompute_s"):
            stats.setdefault(name, 0)
        # chunks recomputed by choice while a tier holds them (key -> that tier): not written again
        # when the disk holds them, not published again
        self._held: dict[str, str] = {}
        self.layout_dims = (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype)
        # evicted chunks (not derived entries): tokens, to recompute one whose file is missing or bad
        self.recomputable: dict[str, torch.Tensor] = {}
        self.stale: set[str] = set()       # keys dropped because the model's weights changed
        self.bad_files: set[str] = set()   # keys of bad files that could not be removed (read-only)
        self._load_errors: dict[str, ChunkStoreError] = {}   # why a key's file failed, for its refusal
        resident.on_evict = self._evicted

    @property
    def fingerprint(self) -> str:
        return self.spec.fingerprint

    def _evicted(self, key: str, e: Entry) -> None:
        if e.variant is None:   # on disk or not: a file may go bad or away, the tokens recompute it
            self.recomputable[key] = e.tokens

    def weights_changed(self, spec: ChunkModel) -> None:
        """Every resident entry and every recomputable chunk belongs to the old weights (stale)."""
        self.stale.update(self.resident.clear())
        self.stale.update(self.recomputable)
        self.recomputable.clear()
        self.spec = spec
        self.resident.set_rope(spec.rope)   # inv_freq is a buffer: it may have changed too

    def _insert(self, key, tokens, k_layers, v_layers, on_disk: bool, variant=None) -> Entry:
        e = self.resident.insert(key, tokens, k_layers, v_layers, on_disk, variant)
        self.recomputable.pop(key, None)
        return e

    # ----- the disk tier -------------------------------------------------------------------------
    @property
    def writable(self) -> bool:
        return self.disk is not None and self.disk.writable

    def path(self, key: str) -> Path:
        return self.disk.path(key)

    def on_disk(self, key: str) -> bool:
        """A complete file of ``key`` for the current weights is in the directory (header and
        size checked: a truncated file, or another model's, is not; it is replaced when the
        chunk is computed again, never deleted)."""
        return self.disk is not None and key not in self.bad_files and self.disk.has(key, self.fingerprint)

    def has(self, key: str) -> bool:
        return key in self.resident.entries or self.on_disk(key)

    def _bad_file(self, key: str) -> None:
        """The file of ``key``, complete and of this model by its header, failed its checks (a
        corrupt file): remove it (a read-only directory: remember it), so that it is recomputed,
        or reported missing, from now on."""
        self.stats["bad_files"] += 1
        if not self.disk.remove(key):
            self.bad_files.add(key)

    def _note_damaged(self, key: str) -> None:
        """Before ``key`` is computed again: a file of it that is there but not loadable by its
        header and size (truncated, emptied) is a bad file, counted once; the computation replaces
        it (a read-only directory: it is remembered, and the chunk stays in memory only)."""
        if self.disk is not None and key not in self.bad_files and self.disk.exists(key) \
                and not self.disk.has(key, self.fingerprint):
            self.stats["bad_files"] += 1
            if not self.writable:
                self.bad_files.add(key)

    def _refuse_damaged(self, key: str) -> None:
        """``key`` is neither resident nor loadable nor recomputable here: when a file of it is
        there (truncated, emptied), raise an error naming it (not "no chunk with key")."""
        if self.disk is not None and self.disk.exists(key) and not self.on_disk(key):
            raise ChunkStoreError(
                f"ragattn.ChunkStore: the file {self.path(key)} of chunk {key!r} is truncated or not a "
                "chunk file of this model, and this store does not know the chunk's tokens to recompute "
                "it: add() them again (the file is replaced)")

    def _write_file(self, key, tokens, k, v, variant=None, directory: Path | None = None) -> Path:
        """Write ``k``, ``v`` ``[L, n, Hkv, D]`` and ``tokens`` to ``<directory>/<key>.safetensors``
        atomically (the store's directory by default)."""
        return write_chunk_file(self.disk.directory if directory is None else directory, key, tokens, k, v,
                                self.fingerprint, variant)

    def verify(self, key: str) -> bool:
        """``ChunkStore.verify``: a file read whole and checked; a bad one removed; a chunk found
        only on the remote tier fetched and kept."""
        if key in self.resident.entries:
            return True
        if not self.on_disk(key):
            return self._fetch_remote(key)
        try:
            read_chunk_file(self.path(key), self.fingerprint, self.layout_dims)
        except ChunkStoreError:
            self._bad_file(key)
            return False
        return True

    def save(self, key: str, directory: str | os.PathLike | None = None) -> Path:
        """``ChunkStore.save``: a chunk written to ``<directory>/<key>.safetensors`` atomically."""
        own = self.disk.directory if self.disk is not None else None
        d = Path(directory) if directory is not None else own
        if d is None:
            raise ChunkStoreError("ragattn.ChunkStore.save: the store has no directory")
        if directory is None and self.disk.read_only:
            raise ChunkStoreError(f"ragattn.ChunkStore.save: the store's directory {d} is read-only")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ChunkStoreError(f"ragattn.ChunkStore.save: cannot create directory {d} "
                                  f"({exc.strerror or exc})") from None
        e = self.get(key)
        k, v = (torch.stack(x) for x in self.resident.read_local(e))
        path = self._write_file(key, e.tokens, k, v, e.variant, d)
        if directory is None:
            e.on_disk = True
        return path

    def load(self, key_or_path: str | os.PathLike) -> str:
        """``ChunkStore.load``: one chunk file, by key in the store's directory or by path."""
        p = Path(key_or_path)
        if not is_chunk_file(p):
            text = str(key_or_path)
            if not _KEY.match(text):
                raise ChunkStoreError(f"ragattn.ChunkStore.load: {text!r} is neither a chunk key (40 hex "
                                      "digits) nor a chunk file (<key>.safetensors)")
            if self.disk is None:
                raise ChunkStoreError(f"ragattn.ChunkStore.load: key {text!r}: a bare key needs a store "
                                      "directory (this store has none)")
            p = self.path(text)
        return self._load(p)

    def _load(self, p: Path) -> str:
        key, tokens, k, v, variant = read_chunk_file(p, self.fingerprint, self.layout_dims)
        if key in self.resident.entries:
            self.resident.entries.move_to_end(key)
        else:
            on_disk = self.disk is not None and p.resolve() == self.path(key).resolve()
            self.stats["loaded"] += 1
            self._insert(key, tokens, k, v, on_disk, variant)
        return key

    # ----- the tiers past memory: the one miss order ----------------------------------------------
    def _fetch_remote(self, key: str) -> bool:
        """Load ``key`` from the remote tier (verified; written to the disk tier too) if it is there."""
        if self.remote is None:
            return False
        got = self.remote.fetch(key, self.fingerprint, self.layout_dims)
        if got is None:
            return False
        _, tokens, k, v, variant = got
        if self.writable:
            self._write_file(key, tokens, k, v, variant)
            self.bad_files.discard(key)
        self._insert(key, tokens, list(k), list(v), self.writable, variant)
        return True

    def _recompute_instead(self, tier: str, key: str, n_tokens: int | None) -> bool:
        """Whether ``key`` (``n_tokens`` known tokens; None: unknown, never) is to be recomputed
        rather than read from ``tier``, by :attr:`costs`; counted, and remembered so that the
        recomputation neither rewrites nor republishes what the tier holds."""
        if n_tokens is None or not self.costs.prefer_recompute(tier, n_tokens, self.resident.pool.row_bytes):
            return False
        self.stats["recompute_chosen"] += 1
        self._held[key] = tier
        return True

    def _from_tiers(self, key: str, n_tokens: int | None = None) -> bool:
        """Make ``key`` resident from the tiers past memory, in the one order every path follows
        (``get``, ``pin``, ``add``): its verified file, else the remote tier. True when resident;
        False leaves a recomputation (from known tokens) or a refusal to the caller. A file that
        fails its checks is counted and removed (:meth:`_bad_file`); why is kept for the refusal.
        ``n_tokens``: the chunk's length when the caller knows its tokens: a tier that
        :attr:`costs` models dearer than recomputing them is passed over (False)."""
        if self.on_disk(key):
            if self._recompute_instead("disk", key, n_tokens):
                return False
            t0 = time.perf_counter()
            try:
                self._load(self.path(key))
                return True
            except ChunkStoreError as exc:   # truncated or corrupt: replaced when computed again
                self._bad_file(key)
                self._load_errors[key] = exc
            finally:
                self.stats["disk_s"] += time.perf_counter() - t0
        if self.remote is not None and self._recompute_instead("remote", key, n_tokens):
            return False
        t0 = time.perf_counter()
        try:
            return self._fetch_remote(key)
        finally:
            self.stats["remote_s"] += time.perf_counter() - t0

    # ----- computing chunks --------------------------------------------------------------------------
    def _check_tokens(self, chunks) -> list[np.ndarray]:
        """Each chunk as a 1-D int64 array (numpy: no torch dispatch per chunk on the hot path)."""
        toks = []
        max_positions, vocab_size = self.spec.max_positions, self.spec.vocab_size
        for c in chunks:
            a = c.detach().cpu().numpy() if isinstance(c, torch.Tensor) else np.asarray(c)
            if a.ndim != 1:
                raise ChunkStoreError(f"ragattn.ChunkStore.add: a chunk must be a 1-D sequence of token ids, "
                                      f"got shape {tuple(a.shape)}")
            if a.size == 0:
                raise ChunkStoreError("ragattn.ChunkStore.add: a chunk has no tokens")
            if a.dtype.kind not in "iu":
                raise ChunkStoreError(f"ragattn.ChunkStore.add: token ids must be integers, got {a.dtype}")
            if a.size > max_positions:
                raise ChunkStoreError(
                    f"ragattn.ChunkStore.add: chunk of {a.size} tokens is longer than the model's "
                    f"window (max_position_embeddings={max_positions})")
            toks.append(np.ascontiguousarray(a.reshape(-1), dtype=np.int64))
        if toks:
            flat = np.concatenate(toks) if len(toks) > 1 else toks[0]
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or (vocab_size is not None and hi >= vocab_size):
                raise ChunkStoreError(f"ragattn.ChunkStore.add: token id {lo if lo < 0 else hi} is outside "
                                      f"the model's vocabulary [0, {vocab_size})")
        return toks

    def add(self, chunks: Sequence[Sequence[int]]) -> list[str]:
        """``ChunkStore.add``: keys of the chunks, each resident or in a tier, the misses prefilled."""
        toks = self._check_tokens(chunks)
        fp = self.fingerprint.encode()
        keys = [hashlib.sha256(fp + t.tobytes()).hexdigest()[:40] for t in toks]   # == chunk_key
        entries = self.resident.entries
        missing, seen = [], set()
        for k, t in zip(keys, toks):
            if k in entries:
                entries.move_to_end(k)
                continue
            if k in seen or self._from_tiers(k, len(t)):
                continue
            seen.add(k)
            missing.append((k, torch.from_numpy(t)))
        self._prefill(missing)
        return keys

    def _prefill(self, items, pinned: list | None = None):
        """Prefill ``(key, tokens)`` items in packed batches; with ``pinned``, pin each new entry
        (appended to it) as soon as it is resident."""
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
        spec, device = self.spec, self.resident.device
        lens = [t.numel() for _, t in batch]
        ids = torch.cat([t for _, t in batch]).to(device)
        pos = torch.cat([torch.arange(n) for n in lens]).to(device)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lens).cumsum(0)
        if spec.prefill is None:
            raise ChunkStoreError(f"ragattn.ChunkStore.add: {len(batch)} chunk(s) are not in the store and its "
                                  "model cannot compute them (it serves chunk files only)")
        t0 = time.perf_counter()
        ks, vs = spec.prefill(ids, pos, cu.to(device))     # per layer [T, Hkv, D]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.stats["recompute_s"] += time.perf_counter() - t0
        if len(ks) != spec.num_layers or len(vs) != spec.num_layers:
            raise RuntimeError(f"ragattn.ChunkStore: the prefill returned {len(ks)} K and {len(vs)} V layers, "
                               f"expected {spec.num_layers}")
        for (key, t), a, b in zip(batch, cu[:-1].tolist(), cu[1:].tolist()):
            k_layers, v_layers = [k[a:b] for k in ks], [v[a:b] for v in vs]
            self._note_damaged(key)
            self._load_errors.pop(key, None)
            held = self._held.pop(key, None)    # recomputed by choice: that tier holds it already
            on_disk = self.writable or held == "disk"
            if self.writable and held != "disk":  # on disk first: a failed write leaves nothing half-added
                self._write_file(key, t, torch.stack(k_layers), torch.stack(v_layers))
                self.bad_files.discard(key)
            if self.remote is not None and held is None:
                self.remote.publish(key, t, torch.stack(k_layers), torch.stack(v_layers), self.fingerprint)
            self.stats["recomputed" if key in self.recomputable else "computed"] += 1
            e = self._insert(key, t, k_layers, v_layers, on_disk=on_disk)
            if pinned is not None:
                e.pins += 1
                pinned.append(e)

    def put(self, key: str, variant: str, k_layers: Sequence[torch.Tensor],
            v_layers: Sequence[torch.Tensor]) -> str:
        """``ChunkStore.put``: a derived entry of the chunk ``key``, written through every tier."""
        spec = self.spec
        tokens = self.tokens_of(key)
        want = (tokens.numel(), spec.num_kv_heads, spec.head_dim)
        if len(k_layers) != spec.num_layers or len(v_layers) != spec.num_layers or any(
                tuple(t.shape) != want for t in [*k_layers, *v_layers]):
            raise ChunkStoreError(f"ragattn.ChunkStore.put: expected {spec.num_layers} layers of K and "
                                  f"V of shape {want} ([n, Hkv, D])")
        bad = {str(t.dtype) for t in [*k_layers, *v_layers] if t.dtype != spec.dtype}
        if bad:   # a file in another dtype could never be loaded again
            raise ChunkStoreError(f"ragattn.ChunkStore.put: K/V must have the model's dtype {spec.dtype}, "
                                  f"got {', '.join(sorted(bad))}")
        vkey = variant_key(self.fingerprint, key, variant)
        entries = self.resident.entries
        if vkey in entries and entries[vkey].pins:   # refused before anything is written
            raise ChunkStoreError(f"ragattn.ChunkStore.put: the entry {vkey!r} (variant {variant!r}) is "
                                  f"{self.resident.pinned_by(entries[vkey])}: release it first")
        on_disk = False
        if self.writable:
            self._write_file(vkey, tokens, torch.stack(list(k_layers)), torch.stack(list(v_layers)),
                             (key, variant))
            on_disk = True
        if self.remote is not None:    # replaced there too: no process is served the old variant
            self.remote.publish(vkey, tokens, torch.stack(list(k_layers)), torch.stack(list(v_layers)),
                                self.fingerprint, (key, variant), replace=True)
        if vkey in entries:
            self.resident.evict(vkey)
        self._insert(vkey, tokens, k_layers, v_layers, on_disk, (key, variant))
        return vkey

    # ----- a key to its entry ------------------------------------------------------------------------
    def tokens_of(self, key: str) -> torch.Tensor:
        e = self.resident.entries.get(key)
        if e is not None:
            return e.tokens
        if key in self.recomputable:
            return self.recomputable[key]
        return self.get(key).tokens

    def _known_length(self, key: str) -> int | None:
        t = self.recomputable.get(key)
        return None if t is None else t.numel()

    def get(self, key: str) -> Entry:
        """The entry of ``key``, made resident if needed (marked used): memory, else disk, else
        remote, else recomputed from its tokens, else an error saying why."""
        entries = self.resident.entries
        e = entries.get(key)
        if e is not None:
            entries.move_to_end(key)
            return e
        if not self._from_tiers(key, self._known_length(key)):
            if key not in self.recomputable:
                self._refuse(key)
            self._prefill([(key, self.recomputable[key])])
        return entries[key]

    def _refuse(self, key: str) -> None:
        """``key`` is in no tier and its tokens are unknown here: raise the reason (earlier
        weights, a damaged file, an unknown key)."""
        if key in self.stale:
            raise ChunkStoreError(
                f"ragattn.ChunkStore: chunk {key!r} was computed with the model's earlier weights "
                "(they changed since): add() its tokens again for its key under the current weights")
        exc = self._load_errors.pop(key, None)
        if exc is not None:
            raise ChunkStoreError(f"{exc} (removed from the store: it cannot be recomputed here, build it "
                                  "again)") from None
        self._refuse_damaged(key)
        raise ChunkStoreError(f"ragattn.ChunkStore: no chunk with key {key!r} in the store")

    def pin(self, keys: Sequence[str]) -> tuple[list[Entry], list[Entry]]:
        """``(entries of keys in order, pinned)``: every entry resident and pinned, the resident
        ones first, so that loading or recomputing the others never evicts one of them (the
        misses to recompute share one packed prefill). Release with :meth:`ResidentSet.unpin`
        (``pinned``: each distinct entry once)."""
        entries = self.resident.entries
        pinned: list[Entry] = []
        try:
            unique = list(dict.fromkeys(keys))
            for k in unique:
                e = entries.get(k)
                if e is not None:
                    e.pins += 1
                    pinned.append(e)
            recompute = []
            for k in unique:
                if k in entries:
                    continue
                if self._from_tiers(k, self._known_length(k)):
                    e = entries[k]
                    e.pins += 1
                    pinned.append(e)
                elif k in self.recomputable:
                    recompute.append((k, self.recomputable[k]))
                else:
                    self._refuse(k)
            self._prefill(recompute, pinned)
            out = []
            for k in keys:
                entries.move_to_end(k)
                out.append(entries[k])
            return out, pinned
        except BaseException:
            ResidentSet.unpin(pinned)
            raise
