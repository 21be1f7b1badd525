"""The chunk KV store: precomputed per-chunk KV caches, in memory and on disk.

    from ragattn.methods.chunk_store import ChunkStore
    store = ChunkStore(model, directory="kv/")          # directory optional (memory only)
    keys = store.add([tok_ids_a, tok_ids_b, ...])       # one batched independent prefill of the misses
    req = store.assemble(keys, positions="reordered", extra_slots=64)
    # req.cache: ragattn.hf.attention.PagedKV holding the chunks' K/V at their request slots,
    # keys re-rotated to their request positions; req.next_position: RoPE position after the chunks.

Chunk K/V are computed by one ``varlen_attention`` forward over all missing chunks packed (one
sequence per chunk, positions 0..n-1 per chunk), so each chunk's keys are stored rotated at its
local positions ``0..n-1``. A chunk's key is ``sha256(model fingerprint, token ids)``; the model
fingerprint hashes the model's name, config and a sample of every weight tensor.

In memory the store is a pool per layer ``[rows, Hkv, D]`` (K and V) with a row range per chunk,
so assembling a request is a single ``ragattn.copy_kv_`` (all layers, all chunks) that also
re-rotates each chunk's keys by ``delta = new_start - 0`` (reordered positions) or 0 (composite).
:meth:`ChunkStore.pooled_kv` copies the whole pool out (e.g. to pinned host memory) and
:meth:`ChunkStore.load_pooled_kv_` copies it back, for keeping chunk KV off the GPU.

Derived entries (a variant of a chunk, e.g. FusionRAG's fused cache: the same tokens prefilled
after other context, keys re-rotated back to the chunk's local positions ``0..n-1``) are stored
with :meth:`ChunkStore.put` under ``variant_key(key, variant)`` and assemble like chunks.

On disk: one ``<key>.safetensors`` per chunk (``k``, ``v`` ``[L, n, Hkv, D]``, ``tokens`` int64
``[n]``) with metadata (format, model fingerprint, key, sha256 of the tensor bytes). A file is
fully read and verified before anything is inserted: a truncated, corrupt or foreign file raises
``ChunkStoreError`` and is never loaded in part.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ragattn.hf.attention import PagedKV, use_ragattn
from ragattn.hf.rope import RopeParams, rope_params
from ragattn import ops as _ops

FORMAT = "ragattn-chunk-kv-v1"


class ChunkStoreError(ValueError):
    """A chunk or a chunk file that cannot be used (bad input, mismatched model, corrupt file)."""


def model_fingerprint(model) -> str:
    """Hex fingerprint of a model: name, config and a strided sample of every weight (cached)."""
    fp = getattr(model, "_ragattn_fingerprint", None)
    if fp is not None:
        return fp
    h = hashlib.sha256()
    cfg = model.config.to_dict()
    cfg.pop("_attn_implementation_autoset", None)
    cfg.pop("_attn_implementation", None)
    cfg.pop("attn_implementation", None)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, p in model.state_dict().items():
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        sample = flat[::step].to("cpu", torch.float64)
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(sample.numpy().tobytes())
    fp = h.hexdigest()[:32]
    model._ragattn_fingerprint = fp
    return fp


def chunk_key(fingerprint: str, tokens: Sequence[int]) -> str:
    t = torch.as_tensor(list(tokens), dtype=torch.int64)
    return hashlib.sha256(fingerprint.encode() + t.numpy().tobytes()).hexdigest()[:40]


def variant_key(fingerprint: str, key: str, variant: str) -> str:
    return hashlib.sha256(f"{fingerprint}:{key}:{variant}".encode()).hexdigest()[:40]


def _tensor_digest(*ts: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in ts:
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class _Entry:
    start: int        # first pool row
    length: int       # tokens
    tokens: torch.Tensor


@dataclass
class AssembledRequest:
    """A request cache filled with chunks. ``cache`` holds ``num_slots`` slots (row 0 of a batch-1
    ``PagedKV``); ``chunk_starts[i]``/``chunk_lens[i]`` are chunk i's slots, ``positions`` int32
    ``[num_slots]`` the RoPE position of each slot, ``next_position`` where the final block starts."""
    cache: PagedKV
    chunk_starts: list[int]
    chunk_lens: list[int]
    positions: torch.Tensor
    next_position: int

    @property
    def num_slots(self) -> int:
        return int(self.cache.lengths[0])


class ChunkStore:
    """Precomputed chunk KV caches for one model (see module docstring)."""

    def __init__(self, model, directory: str | os.PathLike | None = None, page_size: int = 16,
                 max_batch_tokens: int = 8192):
        self.model = model
        self.config = model.config
        self.rope: RopeParams = rope_params(model)
        self.fingerprint = model_fingerprint(model)
        self.num_layers = self.config.num_hidden_layers
        self.num_kv_heads = self.config.num_key_value_heads
        self.head_dim = self.rope.head_dim
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.page_size, self.max_batch_tokens = page_size, max_batch_tokens
        self.directory = Path(directory) if directory is not None else None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._entries: dict[str, _Entry] = {}
        self._variants: dict[str, tuple[str, str]] = {}  # derived key -> (chunk key, variant)
        self._rows = 0
        self._pool_k = [self._empty(0) for _ in range(self.num_layers)]
        self._pool_v = [self._empty(0) for _ in range(self.num_layers)]

    # ----- pool ---------------------------------------------------------------------------
    def _empty(self, rows):
        return torch.empty(rows, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=self.device)

    def _append(self, key, tokens, k_layers, v_layers):
        """k_layers/v_layers: per layer ``[n, Hkv, D]``."""
        n = int(tokens.numel())
        need = self._rows + n
        if need > self._pool_k[0].shape[0]:
            cap = max(need, 2 * self._pool_k[0].shape[0], 256)
            for pool in (self._pool_k, self._pool_v):
                for l in range(self.num_layers):
                    grown = self._empty(cap)
                    grown[: self._rows] = pool[l][: self._rows]
                    pool[l] = grown
        for l in range(self.num_layers):
            self._pool_k[l][self._rows: need] = k_layers[l]
            self._pool_v[l][self._rows: need] = v_layers[l]
        self._entries[key] = _Entry(self._rows, n, tokens.to("cpu", torch.int64))
        self._rows = need

    @property
    def num_rows(self) -> int:
        """Pool rows in use: the total tokens of every chunk in memory."""
        return self._rows

    def pooled_kv(self, device: str | torch.device = "cpu", pin_memory: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the whole in-memory pool, e.g. to keep the chunk KV in host memory.

        Returns K, V: ``[L, num_rows, Hkv, D]`` each, in the model's dtype, on ``device``;
        ``pin_memory=True`` (CPU ``device`` only, needs CUDA) allocates them in page-locked
        memory so that :meth:`load_pooled_kv_` can copy them to the GPU asynchronously. Row ``r``
        of layer ``l`` is the store's pool row, so the copy is only meaningful to this store.
        Keys are rotated at each chunk's local positions ``0..n-1``."""
        device = torch.device(device)
        if pin_memory and device.type != "cpu":
            raise ChunkStoreError(f"ragattn.ChunkStore.pooled_kv: pin_memory needs device 'cpu', "
                                  f"got {device}")
        shape = (self.num_layers, self._rows, self.num_kv_heads, self.head_dim)
        out = []
        for pool in (self._pool_k, self._pool_v):
            t = torch.empty(shape, dtype=self.dtype, device=device, pin_memory=pin_memory)
            for l in range(self.num_layers):
                t[l].copy_(pool[l][: self._rows])
            out.append(t)
        return out[0], out[1]

    def load_pooled_kv_(self, k: torch.Tensor, v: torch.Tensor, non_blocking: bool = False) -> None:
        """Overwrite the in-memory pool with ``k``, ``v`` from :meth:`pooled_kv` (any device).

        ``k``, ``v``: ``[L, num_rows, Hkv, D]`` in the store's dtype, taken from this store with
        the same chunks in it (adding chunks afterwards makes them stale: ChunkStoreError).
        ``non_blocking=True`` with pinned host tensors makes the host-to-device copies
        asynchronous (ordered on the current stream before later kernels)."""
        want = (self.num_layers, self._rows, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise ChunkStoreError(f"ragattn.ChunkStore.load_pooled_kv_: {name} must be a tensor, "
                                      f"got {type(t).__name__}")
            if tuple(t.shape) != want:
                raise ChunkStoreError(f"ragattn.ChunkStore.load_pooled_kv_: {name} has shape "
                                      f"{tuple(t.shape)}, expected {want} ([L, num_rows, Hkv, D])")
            if t.dtype != self.dtype:
                raise ChunkStoreError(f"ragattn.ChunkStore.load_pooled_kv_: {name} has dtype {t.dtype}, "
                                      f"expected {self.dtype}")
        for pool, src in ((self._pool_k, k), (self._pool_v, v)):
            for l in range(self.num_layers):
                pool[l][: self._rows].copy_(src[l], non_blocking=non_blocking)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, tokens: Sequence[int]) -> str:
        return chunk_key(self.fingerprint, tokens)

    def variant_key(self, key: str, variant: str) -> str:
        """Key of the derived entry ``variant`` (a name, e.g. "fused-...") of the chunk ``key``."""
        return variant_key(self.fingerprint, key, variant)

    def has(self, key: str) -> bool:
        """Whether ``key`` is in memory or on disk in the store's directory (nothing is loaded)."""
        return key in self._entries or (self.directory is not None and self._path(key).is_file())

    def put(self, key: str, variant: str, k_layers: Sequence[torch.Tensor],
            v_layers: Sequence[torch.Tensor]) -> str:
        """Store a derived entry of the chunk ``key`` (which must be in the store); returns its key.

        ``k_layers``, ``v_layers``: per layer ``[n, Hkv, D]`` (``n`` = the chunk's tokens), keys
        rotated at the chunk's local positions ``0..n-1``. Written to the directory, if any."""
        tokens = self._get(key).tokens
        want = (tokens.numel(), self.num_kv_heads, self.head_dim)
        if len(k_layers) != self.num_layers or len(v_layers) != self.num_layers or any(
                tuple(t.shape) != want for t in [*k_layers, *v_layers]):
            raise ChunkStoreError(f"ragattn.ChunkStore.put: expected {self.num_layers} layers of K and "
                                  f"V of shape {want} ([n, Hkv, D])")
        vkey = self.variant_key(key, variant)
        if vkey in self._entries:
            e = self._entries[vkey]
            for l in range(self.num_layers):
                self._pool_k[l][e.start: e.start + e.length] = k_layers[l]
                self._pool_v[l][e.start: e.start + e.length] = v_layers[l]
        else:
            self._append(vkey, tokens, k_layers, v_layers)
        self._variants[vkey] = (key, variant)
        if self.directory is not None:
            self.save(vkey)
        return vkey

    def kv(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of a stored chunk: ``[L, n, Hkv, D]`` each (copies; keys at local positions)."""
        e = self._get(key)
        sl = slice(e.start, e.start + e.length)
        return (torch.stack([p[sl] for p in self._pool_k]), torch.stack([p[sl] for p in self._pool_v]))

    def tokens(self, key: str) -> torch.Tensor:
        return self._get(key).tokens

    def _get(self, key):
        e = self._entries.get(key)
        if e is None and self.directory is not None and self._path(key).is_file():
            self.load(key)
            e = self._entries[key]
        if e is None:
            raise ChunkStoreError(f"ragattn.ChunkStore: no chunk with key {key!r} in the store")
        return e

    # ----- compute --------------------------------------------------------------------------
    def _check_tokens(self, tokens) -> torch.Tensor:
        t = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        if t.numel() == 0:
            raise ChunkStoreError("ragattn.ChunkStore.add: a chunk has no tokens")
        if t.numel() > self.max_positions:
            raise ChunkStoreError(
                f"ragattn.ChunkStore.add: chunk of {t.numel()} tokens is longer than the model's "
                f"window (max_position_embeddings={self.max_positions})")
        return t

    @torch.no_grad()
    def add(self, chunks: Sequence[Sequence[int]]) -> list[str]:
        """Store the KV of every chunk (token id lists); returns their keys in order.

        Chunks already in memory or on disk are not recomputed; the rest are prefilled together
        (packed, one independent sequence per chunk) in batches of ``max_batch_tokens`` tokens."""
        toks = [self._check_tokens(c) for c in chunks]
        keys = [self.key(t.tolist()) for t in toks]
        missing, seen = [], set()
        for k, t in zip(keys, toks):
            if k in self._entries or k in seen:
                continue
            if self.directory is not None and self._path(k).is_file():
                self.load(k)
                continue
            seen.add(k)
            missing.append((k, t))
        batch, n = [], 0
        for item in missing:
            if batch and n + item[1].numel() > self.max_batch_tokens:
                self._prefill(batch)
                batch, n = [], 0
            batch.append(item)
            n += item[1].numel()
        if batch:
            self._prefill(batch)
        return keys

    def _prefill(self, batch):
        lens = [t.numel() for _, t in batch]
        ids = torch.cat([t for _, t in batch])[None].to(self.device)
        pos = torch.cat([torch.arange(n) for n in lens])[None].to(self.device)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lens).cumsum(0)
        capture: list = []
        base = getattr(self.model, "model", self.model)
        with use_ragattn(self.model):
            base(input_ids=ids, position_ids=pos, use_cache=False, ragattn_cu_seqlens=cu.to(self.device),
                 ragattn_capture=capture)
        if len(capture) != self.num_layers:
            raise RuntimeError(f"ragattn.ChunkStore: captured {len(capture)} layers, expected {self.num_layers}")
        ks = [k[0].transpose(0, 1) for k, _ in capture]     # [T, Hkv, D]
        vs = [v[0].transpose(0, 1) for _, v in capture]
        for (key, t), a, b in zip(batch, cu[:-1].tolist(), cu[1:].tolist()):
            self._append(key, t, [k[a:b] for k in ks], [v[a:b] for v in vs])
            if self.directory is not None:
                self.save(key)

    # ----- disk -----------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.safetensors"

    def save(self, key: str, directory: str | os.PathLike | None = None) -> Path:
        """Write a chunk to ``<directory>/<key>.safetensors`` atomically; returns the path."""
        from safetensors.torch import save_file

        d = Path(directory) if directory is not None else self.directory
        if d is None:
            raise ChunkStoreError("ragattn.ChunkStore.save: the store has no directory")
        d.mkdir(parents=True, exist_ok=True)
        k, v = self.kv(key)
        tokens = self._entries[key].tokens
        meta = {"format": FORMAT, "fingerprint": self.fingerprint, "key": key,
                "num_tokens": str(tokens.numel()), "sha256": _tensor_digest(k, v, tokens)}
        if key in self._variants:
            meta["variant"] = self._variants[key][1]
        path = d / f"{key}.safetensors"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({"k": k.cpu().contiguous(), "v": v.cpu().contiguous(), "tokens": tokens}, str(tmp),
                  metadata=meta)
        os.replace(tmp, path)
        return path

    def load(self, key_or_path: str | os.PathLike) -> str:
        """Load and verify one chunk file (by key in the store's directory, or by path); returns its key."""
        from safetensors import safe_open

        p = Path(key_or_path)
        if not p.suffix == ".safetensors":
            if self.directory is None:
                raise ChunkStoreError("ragattn.ChunkStore.load: a bare key needs a store directory")
            p = self._path(str(key_or_path))
        try:
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {n: f.get_tensor(n) for n in ("k", "v", "tokens")}
        except Exception as exc:  # truncated / not safetensors / missing tensor
            raise ChunkStoreError(f"ragattn.ChunkStore.load: {p} is not a complete chunk file "
                                  f"({type(exc).__name__}: {exc})") from exc
        if meta.get("format") != FORMAT:
            raise ChunkStoreError(f"ragattn.ChunkStore.load: {p} has format {meta.get('format')!r}, "
                                  f"expected {FORMAT!r}")
        if meta.get("fingerprint") != self.fingerprint:
            raise ChunkStoreError(
                f"ragattn.ChunkStore.load: {p} was computed by another model (fingerprint "
                f"{meta.get('fingerprint')!r}, this model {self.fingerprint!r})")
        k, v, tokens = tensors["k"], tensors["v"], tensors["tokens"]
        want = (self.num_layers, tokens.numel(), self.num_kv_heads, self.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ChunkStoreError(f"ragattn.ChunkStore.load: {p} holds K/V of shape {tuple(k.shape)}, "
                                  f"expected {want}")
        if _tensor_digest(k, v, tokens) != meta.get("sha256"):
            raise ChunkStoreError(f"ragattn.ChunkStore.load: {p} fails its checksum (corrupt file)")
        key = chunk_key(self.fingerprint, tokens.tolist())
        variant = meta.get("variant")
        if variant is not None:
            base, key = key, variant_key(self.fingerprint, key, variant)
        if key != meta.get("key"):
            raise ChunkStoreError(f"ragattn.ChunkStore.load: {p} holds key {meta.get('key')!r}, "
                                  f"but its tokens hash to {key!r}")
        if key not in self._entries:
            self._append(key, tokens, [t.to(self.device, self.dtype) for t in k],
                         [t.to(self.device, self.dtype) for t in v])
        if variant is not None:
            self._variants[key] = (base, variant)
        return key

    # ----- assembly -------------------------------------------------------------------------
    @torch.no_grad()
    def assemble(self, keys: Sequence[str], positions: str = "reordered", extra_slots: int = 0,
                 rerotate: bool = True, page_size: int | None = None) -> AssembledRequest:
        """Gather chunks (in this order) into a fresh paged request cache.

        ``positions``: "reordered" (chunk i at consecutive positions ``o_i + j``, keys re-rotated
        by ``o_i`` in the same ``copy_kv_`` pass) or "composite" (every chunk keeps ``0..n_i-1``;
        the final block starts at ``max n_i``). ``extra_slots``: room for the final block and the
        generated tokens. ``rerotate=False`` skips the rotation (wrong on purpose; for tests).
        """
        if positions not in ("reordered", "composite"):
            raise ChunkStoreError(f"ragattn.ChunkStore.assemble: positions must be 'reordered' or "
                                  f"'composite', got {positions!r}")
        if len(keys) == 0:
            raise ChunkStoreError("ragattn.ChunkStore.assemble: no chunks given (empty retrieval)")
        entries = [self._get(k) for k in keys]
        lens = [e.length for e in entries]
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        total = sum(lens)
        next_pos = total if positions == "reordered" else max(lens)
        if next_pos + extra_slots > self.max_positions:
            raise ChunkStoreError(
                f"ragattn.ChunkStore.assemble: {total} chunk tokens + {extra_slots} extra slots exceed "
                f"the model's window (max_position_embeddings={self.max_positions})")
        cache = PagedKV(self.num_layers, 1, total + extra_slots, self.num_kv_heads, self.head_dim,
                        page_size or self.page_size, self.dtype, self.device)
        dev = self.device
        src = torch.cat([torch.arange(e.start, e.start + e.length) for e in entries]).to(dev)
        slots = torch.arange(total, device=dev)
        dst = cache.slot_rows(0, slots)
        if positions == "reordered":
            pos = slots.to(torch.int32)
        else:
            pos = torch.cat([torch.arange(n) for n in lens]).to(dev, torch.int32)
        local = torch.cat([torch.arange(n) for n in lens]).to(dev, torch.int32)
        delta = (pos - local).to(torch.int32)
        rotate = rerotate and bool((delta != 0).any())
        _ops.copy_kv_(cache.k, cache.v, self._pool_k, self._pool_v, src, dst,
                      delta if rotate else None, self.rope.inv_freq.to(dev) if rotate else None,
                      self.rope.rotary_dim if rotate else 0, self.rope.interleaved)
        cache.lengths[0] = total
        return AssembledRequest(cache, starts, lens, pos, next_pos)
