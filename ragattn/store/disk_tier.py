"""The chunk store's disk tier: one safetensors file per chunk, written atomically and fully
verified before anything of it is used.

A file ``<key>.safetensors`` (:func:`chunk_file`, the one naming rule) holds ``k``, ``v`` ``[L, n, Hkv, D]`` (the model's dtype) and
``tokens`` int64 ``[n]``, with metadata: format, model fingerprint, key, sha256 of the tensor bytes
(and the variant name of a derived entry)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from pathlib import Path

import torch

from ragattn.store.errors import ChunkStoreError, ForeignChunkError
from ragattn.store.fingerprint import chunk_key, variant_key

FORMAT = "ragattn-chunk-kv-v1"
# temporary files of a write (<key>.tmp<pid>-<writer>) and the directory's write probe, named by
# the writer's pid (orphans of dead processes are removed) and a token unique to each write (several
# stores, threads, in one process never share a name); names without the token: older writers
_ORPHAN = re.compile(r"^(?:[0-9a-f]{40}\.tmp|\.ragattn-write-probe-)(\d+)(?:-[0-9a-f]{32})?$")


CHUNK_SUFFIX = ".safetensors"


def chunk_file(directory: str | os.PathLike, key: str) -> Path:
    """The one naming rule of chunk files: the file of ``key`` in ``directory``,
    ``<directory>/<key>.safetensors``."""
    return Path(directory) / f"{key}{CHUNK_SUFFIX}"


def is_chunk_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is named like a chunk file (``<key>.safetensors``; its content is not read)."""
    return Path(path).suffix == CHUNK_SUFFIX


def chunk_files(directory: str | os.PathLike) -> list[Path]:
    """The files named like chunk files in ``directory``, sorted (none are read)."""
    return sorted(Path(directory).glob(f"*{CHUNK_SUFFIX}"))


def _unique_suffix() -> str:
    """``<pid>-<uuid4 hex>``: a temporary name no other write (any process, thread or store) uses."""
    return f"{os.getpid()}-{uuid.uuid4().hex}"


def probe_writable_dir(d: Path) -> None:
    """Create folder ``d`` if needed and write (then remove) an empty probe file in it, so that an
    unwritable directory is found before any work; raises the ``OSError`` otherwise. (The command
    lines check their output folders with it too: ``ragattn.apps.cli.writable_dir``.)"""
    probe = d / f".ragattn-write-probe-{_unique_suffix()}"
    d.mkdir(parents=True, exist_ok=True)
    probe.write_bytes(b"")
    probe.unlink()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:      # EPERM: alive, another user's
        return True
    return True


def _tensor_digest(*ts: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in ts:
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())     # the buffer, not a copy
    return h.hexdigest()


class DiskTier:
    """The chunk files of one store directory. ``layout``: ``(num_layers, num_kv_heads, head_dim,
    dtype)`` every file must hold; ``read_only``: never write (``writable`` is False)."""

    def __init__(self, directory: str | os.PathLike, read_only: bool, layout: tuple):
        self.directory = Path(directory)
        self.read_only = bool(read_only)
        self.num_layers, self.num_kv_heads, self.head_dim, self.dtype = layout
        self._open()

    def _open(self):
        d = self.directory
        if self.read_only:
            if not d.is_dir():
                raise ChunkStoreError(f"ragattn.ChunkStore: directory {d} does not exist (read_only=True)")
            return
        try:
            probe_writable_dir(d)
        except OSError as exc:
            raise ChunkStoreError(
                f"ragattn.ChunkStore: cannot write chunk files to directory {d} ({exc.strerror or exc}); "
                "pass read_only=True to serve the chunks already in it") from None
        self.removed_orphans = self._remove_orphans()

    def _remove_orphans(self) -> int:
        """Remove the temporary files that writers which died (a crash, a kill) left behind; those
        of live processes (other shards writing now) stay. Returns how many were removed."""
        n = 0
        try:
            names = [e.name for e in os.scandir(self.directory) if ".tmp" in e.name or e.name.startswith(".ragattn")]
        except OSError:
            return 0
        for name in names:
            m = _ORPHAN.match(name)
            if m is None or int(m.group(1)) == os.getpid() or _pid_alive(int(m.group(1))):
                continue
            try:
                (self.directory / name).unlink()
                n += 1
            except OSError:
                pass
        return n

    @property
    def writable(self) -> bool:
        return not self.read_only

    def path(self, key: str) -> Path:
        return chunk_file(self.directory, key)

    def exists(self, key: str) -> bool:
        """Whether a file of ``key`` is there (complete or not)."""
        return self.path(key).is_file()

    def has(self, key: str, fingerprint: str) -> bool:
        """Whether the file of ``key`` looks loadable: a chunk file of ``key`` for ``fingerprint``
        (header) of the size its header declares (not truncated). Its checksum is checked at load."""
        try:
            with open(self.path(key), "rb") as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                if not 0 < n <= 1 << 24:
                    return False
                header = json.loads(f.read(n))
                size = os.fstat(f.fileno()).st_size
            meta = header.get("__metadata__") or {}
            end = max(int(v["data_offsets"][1]) for name, v in header.items() if name != "__metadata__")
        except (OSError, ValueError, TypeError, KeyError, AttributeError, IndexError):
            return False
        return (meta.get("format") == FORMAT and meta.get("fingerprint") == fingerprint
                and meta.get("key") == key and size == 8 + n + end)

    def remove(self, key: str) -> bool:
        """Delete the file of ``key`` (a bad one); False when it cannot be (read-only)."""
        if self.read_only:
            return False
        try:
            self.path(key).unlink(missing_ok=True)
            return True
        except OSError:
            return False

    def write(self, key, tokens, k, v, fingerprint: str, variant=None) -> Path:
        return write_chunk_file(self.directory, key, tokens, k, v, fingerprint, variant)

    def read(self, p: Path, fingerprint: str):
        return read_chunk_file(p, fingerprint, (self.num_layers, self.num_kv_heads, self.head_dim, self.dtype))


def encode_chunk(key, tokens, k, v, fingerprint: str, variant=None) -> bytes:
    """The bytes of a chunk file (safetensors: ``k``, ``v`` ``[L, n, Hkv, D]``, ``tokens`` int64
    ``[n]``, metadata: format, fingerprint, key, sha256 of the tensors, variant name): what the disk
    tier writes to ``<key>.safetensors`` and the remote tier (:mod:`.remote_tier`) stores."""
    from safetensors.torch import save

    k, v = k.detach().cpu().contiguous(), v.detach().cpu().contiguous()
    tokens = tokens.to("cpu", torch.int64).contiguous()
    meta = {"format": FORMAT, "fingerprint": fingerprint, "key": key,
            "num_tokens": str(tokens.numel()), "sha256": _tensor_digest(k, v, tokens)}
    if variant is not None:
        meta["variant"] = variant[1]
    return save({"k": k, "v": v, "tokens": tokens}, metadata=meta)


def write_chunk_file(d: Path, key, tokens, k, v, fingerprint: str, variant=None) -> Path:
    """Write ``k``, ``v`` ``[L, n, Hkv, D]`` and ``tokens`` to ``<d>/<key>.safetensors``
    atomically and durably: a temporary file, flushed to the device (fsync), renamed over the
    target, and the directory entry synced; a crash leaves the old file or the new one whole
    (and at worst a temporary file, removed by the next writer that opens the directory)."""
    data = encode_chunk(key, tokens, k, v, fingerprint, variant)
    path = chunk_file(d, key)
    tmp = path.with_suffix(f".tmp{_unique_suffix()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_directory(d)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise ChunkStoreError(f"ragattn.ChunkStore: cannot write {path.name} to directory {d} "
                              f"({exc.strerror or exc})") from None
    return path


def read_chunk_file(p: Path, fingerprint: str, layout: tuple):
    """Read and verify the chunk file ``p`` (whole: nothing of a bad file is returned) for a model
    of fingerprint ``fingerprint`` and ``layout`` ``(num_layers, num_kv_heads, head_dim, dtype)``.

    Returns ``(key, tokens, k, v, variant)``: ``variant`` is ``(chunk key, variant name)`` of
    a derived entry, else None. A truncated, corrupt or foreign file raises ChunkStoreError."""
    from safetensors import safe_open

    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {n: f.get_tensor(n) for n in ("k", "v", "tokens")}
    except Exception as exc:  # truncated / not safetensors / missing tensor
        raise ChunkStoreError(f"ragattn.ChunkStore.load: {p} is not a complete chunk file "
                              f"({type(exc).__name__}: {exc})") from exc
    return verify_chunk(meta, tensors, fingerprint, layout, p)


def decode_chunk(data: bytes, fingerprint: str, layout: tuple, where: str, authenticated: bool = False):
    """:func:`read_chunk_file` of the bytes of a chunk file (``where`` names them in errors).
    ``authenticated``: the bytes passed a MAC made by the writer over exactly these bytes (the remote
    tier's HMAC), so the tensors' own checksum, which the writer computed, is not recomputed."""
    from safetensors.torch import load

    try:
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
        tensors = load(data)
        tensors = {name: tensors[name] for name in ("k", "v", "tokens")}
    except Exception as exc:  # truncated / not safetensors / missing tensor
        raise ChunkStoreError(f"ragattn.ChunkStore.load: {where} is not a complete chunk file "
                              f"({type(exc).__name__}: {exc})") from exc
    return verify_chunk(meta, tensors, fingerprint, layout, where, checksum=not authenticated)


def verify_chunk(meta: dict, tensors: dict, fingerprint: str, layout: tuple, p, checksum: bool = True):
    """Check a chunk file's metadata and tensors (format, fingerprint, shape and dtype, checksum
    unless ``checksum`` is False, key); returns ``(key, tokens, k, v, variant)`` or raises
    ChunkStoreError naming ``p``:
    ForeignChunkError for another format, fingerprint or layout (a file that is not this store's),
    the base class for a damaged one (checksum, key)."""
    num_layers, num_kv_heads, head_dim, dtype = layout
    if meta.get("format") != FORMAT:
        raise ForeignChunkError(f"ragattn.ChunkStore.load: {p} has format {meta.get('format')!r}, "
                              f"expected {FORMAT!r}")
    if meta.get("fingerprint") != fingerprint:
        raise ForeignChunkError(
            f"ragattn.ChunkStore.load: {p} was computed by another model (fingerprint "
            f"{meta.get('fingerprint')!r}, this model {fingerprint!r})")
    k, v, tokens = tensors["k"], tensors["v"], tensors["tokens"]
    want = (num_layers, tokens.numel(), num_kv_heads, head_dim)
    if tuple(k.shape) != want or tuple(v.shape) != want or k.dtype != dtype or v.dtype != dtype:
        raise ForeignChunkError(f"ragattn.ChunkStore.load: {p} holds K/V of shape {tuple(k.shape)} "
                              f"{k.dtype}, expected {want} {dtype}")
    if checksum and _tensor_digest(k, v, tokens) != meta.get("sha256"):
        raise ChunkStoreError(f"ragattn.ChunkStore.load: {p} fails its checksum (corrupt file)")
    key = chunk_key(fingerprint, tokens)
    variant = meta.get("variant")
    base = None
    if variant is not None:
        base, key = key, variant_key(fingerprint, key, variant)
    if key != meta.get("key"):
        raise ChunkStoreError(f"ragattn.ChunkStore.load: {p} holds key {meta.get('key')!r}, "
                              f"but its tokens hash to {key!r}")
    return key, tokens, k, v, ((base, variant) if variant is not None else None)


def _fsync_directory(d: Path) -> None:
    """Make a rename in ``d`` durable (where the platform allows opening a directory)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
