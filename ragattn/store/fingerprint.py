"""The model fingerprint that keys every chunk: the model's config and an exact checksum of every
weight and buffer (:func:`model_fingerprint`), and the chunk keys derived from it."""
from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from ragattn.store.errors import ChunkStoreError

_BLOCK_BYTES = 64 << 20          # bytes hashed at a time (a CUDA tensor is copied to the host by blocks)


def _config_json(model) -> str:
    cfg = model.config.to_dict()
    # not what the model is: its attention kernel, the path it was loaded from (a store built
    # from "org/model" serves the same weights loaded from /abs/path/model, e.g. by vLLM) and the
    # transformers release that wrote the config (the HF environment and vLLM's pin other releases)
    for k in ("_attn_implementation_autoset", "_attn_implementation", "attn_implementation", "_name_or_path",
              "transformers_version"):
        cfg.pop(k, None)
    return json.dumps(cfg, sort_keys=True, default=str)


def _named_state(model) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer (persistent or not: RoPE's ``inv_freq`` is not in the state
    dict), tied tensors once."""
    return [*model.named_parameters(), *model.named_buffers()]


class TensorChecksum:
    """The checksum of one tensor's bytes, fed in pieces of any size: ``sha256`` of the bytes in
    memory order. Any change of any bit, any move of data (two rows or channels swapped) and any
    pair of changes that a sum would cancel (``+e`` here, ``-e`` there) changes it. One definition
    for :func:`weight_checksums` (tensors in memory) and the vLLM connector's checkpoint files
    (:class:`ragattn.vllm.fingerprint.StreamedChecksum`, the same class), which must agree."""

    def __init__(self):
        self._h = hashlib.sha256()

    def update(self, data) -> None:
        """``data``: bytes or any C-contiguous buffer (a numpy array)."""
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()


def _byte_blocks(t: torch.Tensor):
    """A tensor's bytes in memory order (row-major), as host uint8 arrays of at most about
    ``_BLOCK_BYTES``: no copy of a contiguous CPU tensor, one block at a time otherwise."""
    t = t.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    if t.is_contiguous():
        flat = t.reshape(-1).view(torch.uint8)
        for i in range(0, flat.numel(), _BLOCK_BYTES):
            yield flat[i: i + _BLOCK_BYTES].cpu().numpy()
        return
    rows = max(1, _BLOCK_BYTES // max(1, t[0].numel() * t.element_size()))
    for i in range(0, t.shape[0], rows):
        yield t[i: i + rows].contiguous().reshape(-1).view(torch.uint8).cpu().numpy()


def _tensor_checksum(t: torch.Tensor) -> bytes:
    c = TensorChecksum()
    for block in _byte_blocks(t):
        c.update(block)
    return c.digest()


def weight_checksums(tensors: Sequence[torch.Tensor]) -> list[bytes]:
    """The checksum of each tensor's bytes (:class:`TensorChecksum`: sha256 in memory order),
    32 bytes per tensor. CPU tensors are hashed in place, others copied to the host in blocks of
    ``_BLOCK_BYTES`` (never a full copy); the tensors are spread over up to
    ``torch.get_num_threads()`` threads (hashlib releases the GIL)."""
    tensors = list(tensors)
    for t in tensors:
        if t.device.type == "meta":
            raise ChunkStoreError("ragattn.ChunkStore: cannot fingerprint a model with weights on the "
                                  "meta device (offloaded or not materialised)")
    workers = min(len(tensors), torch.get_num_threads())
    if workers <= 1:
        return [_tensor_checksum(t) for t in tensors]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(_tensor_checksum, tensors))


_SAMPLES = 8                     # words of each CPU tensor re-read by the cached check
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ATTN_KEYS = ("_attn_implementation_autoset", "_attn_implementation", "attn_implementation",
              "_attn_implementation_internal", "_name_or_path")

# Bumped by torch's global registration hooks whenever any module gets a parameter, buffer or
# submodule assigned: a model's tensor list is walked again only after such a change.
_structure_generation = 0


def _bump_generation(*_):
    global _structure_generation
    _structure_generation += 1


for _register in (torch.nn.modules.module.register_module_parameter_registration_hook,
                  torch.nn.modules.module.register_module_buffer_registration_hook,
                  torch.nn.modules.module.register_module_module_registration_hook):
    _register(_bump_generation)


def _config_signature(model) -> str:
    """A cheap stand-in for :func:`_config_json`: equal signatures mean an unchanged config."""
    return repr({k: v for k, v in vars(model.config).items() if k not in _ATTN_KEYS})


def _sample_view(t: torch.Tensor):
    """A numpy view of ``_SAMPLES`` words spread over a contiguous CPU tensor (it sees every later
    write to those words, ``.data`` writes included), or None."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0 or t.element_size() not in _INT_OF_SIZE:
        return None
    a = t.detach().view(_INT_OF_SIZE[t.element_size()]).numpy().reshape(-1)
    return a[:: max(1, -(-a.size // _SAMPLES))]


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:   # an inference tensor tracks no version: its samples and pointer still count
        return -1


def _no_watch():
    return None


class _Watch:
    """What :func:`model_fingerprint` saw last: the tensors, their versions, pointers and sampled
    words, the per-tensor checksums, the config and the fingerprint."""

    def __init__(self, generation, named, cfg_sig, cfg_json, digests, fp):
        self.generation, self.named, self.cfg_sig, self.cfg_json = generation, named, cfg_sig, cfg_json
        self.digests, self.fp = digests, fp
        self.tensors = [t for _, t in named]
        self.views = [_sample_view(t) for t in self.tensors]
        groups: dict = {}      # the views by dtype: one concatenation each, for the quick check
        for v in self.views:
            if v is not None:
                groups.setdefault(v.dtype, []).append(v)
        self.groups = list(groups.values())
        self.state = self.current()
        self.samples = self.per_tensor_samples()

    def __deepcopy__(self, memo):   # a copied model (deepcopy, pickle) starts without a cache:
        return None                 # these views would watch the original's memory

    def __reduce__(self):
        return (_no_watch, ())

    def current(self):
        """(versions and pointers, all sampled words) now: the quick check."""
        try:
            vp = tuple((t._version, t.data_ptr()) for t in self.tensors)
        except RuntimeError:   # an inference tensor tracks no version
            vp = tuple((_version(t), t.data_ptr()) for t in self.tensors)
        return vp, b"".join(np.concatenate(g).tobytes() for g in self.groups)

    def per_tensor_samples(self) -> list:
        return [None if v is None else v.tobytes() for v in self.views]


def model_fingerprint(model, cached: bool = True) -> str:
    """Hex fingerprint of a model: its config (all but the attention implementation and the path
    it was loaded from) and an exact checksum of every parameter and buffer
    (:func:`weight_checksums`) with names, shapes, dtypes.

    ``cached=True`` (what :class:`ChunkStore` does at every call that serves or writes KV) reuses
    the last value while nothing it watches changed, and re-checksums only the tensors that did.
    It sees: any change of the config; a parameter, buffer or submodule assigned anywhere (then
    the model's tensors are listed again); every write through the tensor API, which bumps the
    tensor's version counter (in-place ops such as ``mul_`` under ``no_grad``, optimiser steps,
    ``load_state_dict``, ``copy_``); a tensor moved to other memory (``model.to``, ``p.data = x``);
    and, for CPU tensors, a write that bypasses the version counter (``p.data.mul_(...)``,
    ``p.data.copy_(...)``) when it changes one of ``_SAMPLES`` words spread over the tensor (any
    whole-tensor edit: a scaling, new weights, a LoRA merge). Not seen by the cached check: a
    ``.data`` write to CUDA memory, or one that leaves the sampled words alone (one element):
    ``cached=False`` checksums every byte (a :class:`ChunkStore` does it at creation and in
    :meth:`ChunkStore.refresh`)."""
    hit = getattr(model, "_ragattn_fingerprint_cache", None)
    if not isinstance(hit, _Watch):
        hit = None
    cfg_sig = _config_signature(model)
    if cached and hit is not None and hit.generation == _structure_generation and hit.cfg_sig == cfg_sig \
            and hit.current() == hit.state:
        return hit.fp
    generation = _structure_generation
    named = _named_state(model)
    cfg = _config_json(model) if hit is None or hit.cfg_sig != cfg_sig else hit.cfg_json
    old = {}
    if cached and hit is not None:   # checksums of the tensors that did not change are kept
        vp, samples = hit.current()[0], hit.per_tensor_samples()
        for i, (t, was, now, s_was, s_now) in enumerate(zip(hit.tensors, hit.state[0], vp, hit.samples, samples)):
            if was == now and s_was == s_now:
                old[id(t)] = (t, hit.digests[i])
    todo = [t for _, t in named if id(t) not in old]
    fresh = iter(weight_checksums(todo))
    digests = [old[id(t)][1] if id(t) in old else next(fresh) for _, t in named]
    h = hashlib.sha256(cfg.encode())
    for (name, t), digest in zip(named, digests):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(digest)
    fp = h.hexdigest()[:32]
    model._ragattn_fingerprint_cache = _Watch(generation, named, cfg_sig, cfg, digests, fp)
    return fp


def chunk_key(fingerprint: str, tokens) -> str:
    """``sha256(fingerprint, int64 token bytes)`` (40 hex digits); ``tokens``: ids or an int tensor."""
    t = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    t = np.ascontiguousarray(t.reshape(-1), dtype=np.int64)
    return hashlib.sha256(fingerprint.encode() + t.tobytes()).hexdigest()[:40]


def variant_key(fingerprint: str, key: str, variant: str) -> str:
    return hashlib.sha256(f"{fingerprint}:{key}:{variant}".encode()).hexdigest()[:40]


def key_list(keys, where: str) -> list[str]:
    """The one rule of every API that takes chunk keys: ``keys`` a sequence of str keys, returned
    as a list. One key (a str, bytes) where keys are expected is refused by name: iterated, it
    would be a list of one-character keys (answered as missing chunks, silently)."""
    if isinstance(keys, (str, bytes, bytearray)):
        raise ChunkStoreError(f"{where}: keys must be a sequence of keys, got one key (a "
                              f"{type(keys).__name__}); pass [key]")
    try:
        out = list(keys)
    except TypeError:
        raise ChunkStoreError(f"{where}: keys must be a sequence of keys, got {type(keys).__name__}") from None
    for k in out:
        if not isinstance(k, str):
            raise ChunkStoreError(f"{where}: keys must be str (40 hex digits each), got {k!r}")
    return out
