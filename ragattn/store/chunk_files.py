"""The store's chunk files: which keys are on disk, saving and loading them, and what is done
with a bad file (see :mod:`ragattn.store.chunk_store`, "On disk"; the file format and atomic
writes are :mod:`.disk_tier`'s).

Part of :class:`~ragattn.store.ChunkStore` (a mixin over its ``_disk``, ``directory``,
``read_only``, ``fingerprint``, ``_layout_dims``, ``_bad_files`` and the entries).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ragattn.store.disk_tier import read_chunk_file, write_chunk_file
from ragattn.store.errors import ChunkStoreError

_KEY = re.compile(r"^[0-9a-f]{40}$")


class _ChunkFiles:
    """Disk I/O of the store: the files of its directory (or another one for :meth:`save`)."""

    @property
    def _writable(self) -> bool:
        return self._disk is not None and self._disk.writable

    def _on_disk(self, key: str) -> bool:
        """A complete file of ``key`` for the current weights is in the directory (header and
        size checked: a truncated file, or another model's, is not; it is replaced when the
        chunk is computed again, never deleted)."""
        return self._disk is not None and key not in self._bad_files and self._disk.has(key, self.fingerprint)

    def _bad_file(self, key: str) -> None:
        """The file of ``key``, complete and of this model by its header, failed its checks (a
        corrupt file): remove it (a read-only directory: remember it), so that it is recomputed,
        or reported missing, from now on."""
        self.stats["bad_files"] += 1
        if not self._disk.remove(key):
            self._bad_files.add(key)

    def _note_damaged(self, key: str) -> None:
        """Before ``key`` is computed again: a file of it that is there but not loadable by its
        header and size (truncated, emptied) is a bad file, counted once; the computation replaces
        it (a read-only directory: it is remembered, and the chunk stays in memory only)."""
        if self._disk is not None and key not in self._bad_files and self._disk.exists(key) \
                and not self._disk.has(key, self.fingerprint):
            self.stats["bad_files"] += 1
            if not self._writable:
                self._bad_files.add(key)

    def _refuse_damaged(self, key: str) -> None:
        """``key`` is neither in memory nor loadable nor recomputable here: when a file of it is
        there (truncated, emptied), raise an error naming it (not "no chunk with key")."""
        if self._disk is not None and self._disk.exists(key) and not self._on_disk(key):
            raise ChunkStoreError(
                f"ragattn.ChunkStore: the file {self._path(key)} of chunk {key!r} is truncated or not a "
                "chunk file of this model, and this store does not know the chunk's tokens to recompute "
                "it: add() them again (the file is replaced)")

    def verify(self, key: str) -> bool:
        """Like :meth:`has`, but a file is read whole and checked (checksum included) first; a bad
        one is removed (``has`` turns False). For resuming an offline build: what exists is
        checked, not trusted. Nothing is loaded into the pool, except a chunk found only on the
        remote tier (fetched, verified and kept, so that a resumed build never computes it again)."""
        self._sync()
        if key in self._entries:
            return True
        if not self._on_disk(key):
            return self._fetch_remote(key)
        try:
            read_chunk_file(self._path(key), self.fingerprint, self._layout_dims)
        except ChunkStoreError:
            self._bad_file(key)
            return False
        return True

    def _path(self, key: str) -> Path:
        return self._disk.path(key)

    def _write_file(self, key, tokens, k, v, variant=None, directory: Path | None = None) -> Path:
        """Write ``k``, ``v`` ``[L, n, Hkv, D]`` and ``tokens`` to ``<directory>/<key>.safetensors``
        atomically (the store's directory by default)."""
        return write_chunk_file(self.directory if directory is None else directory, key, tokens, k, v,
                                self.fingerprint, variant)

    def save(self, key: str, directory: str | os.PathLike | None = None) -> Path:
        """Write a chunk to ``<directory>/<key>.safetensors`` atomically; returns the path."""
        self._sync()
        d = Path(directory) if directory is not None else self.directory
        if d is None:
            raise ChunkStoreError("ragattn.ChunkStore.save: the store has no directory")
        if directory is None and self.read_only:
            raise ChunkStoreError(f"ragattn.ChunkStore.save: the store's directory {d} is read-only")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ChunkStoreError(f"ragattn.ChunkStore.save: cannot create directory {d} "
                                  f"({exc.strerror or exc})") from None
        e = self._get(key)
        k, v = (torch.stack(x) for x in self._read_local(e))
        path = self._write_file(key, e.tokens, k, v, e.variant, d)
        if directory is None:
            e.on_disk = True
        return path

    def load(self, key_or_path: str | os.PathLike) -> str:
        """Load and verify one chunk file (by key in the store's directory, or by path); returns its key."""
        self._sync()
        p = Path(key_or_path)
        if not p.suffix == ".safetensors":
            text = str(key_or_path)
            if not _KEY.match(text):
                raise ChunkStoreError(f"ragattn.ChunkStore.load: {text!r} is neither a chunk key (40 hex "
                                      "digits) nor a chunk file (<key>.safetensors)")
            if self.directory is None:
                raise ChunkStoreError(f"ragattn.ChunkStore.load: key {text!r}: a bare key needs a store "
                                      "directory (this store has none)")
            p = self._path(text)
        return self._load(p)

    def _load(self, p: Path) -> str:
        key, tokens, k, v, variant = read_chunk_file(p, self.fingerprint, self._layout_dims)
        if key in self._entries:
            self._entries.move_to_end(key)
        else:
            on_disk = self._disk is not None and p.resolve() == self._path(key).resolve()
            self.stats["loaded"] += 1
            self._insert(key, tokens, k, v, on_disk, variant)
        return key
