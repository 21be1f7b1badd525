"""The model fingerprint that keys every chunk: the model's config and an exact checksum of every
weight and buffer (:func:`model_fingerprint`), and the chunk keys derived from it."""
from __future__ import annotations

import hashlib
import json
from typing import Sequence

import numpy as np
import torch

from ragattn.methods.store.errors import ChunkStoreError

_WORDS_PER_ROW = 64              # checksum rows: 64 int64 words (512 bytes) each


def _config_json(model) -> str:
    cfg = model.config.to_dict()
    # not what the model is: its attention kernel, and the path it was loaded from (a store built
    # from "org/model" serves the same weights loaded from /abs/path/model, e.g. by vLLM)
    for k in ("_attn_implementation_autoset", "_attn_implementation", "attn_implementation", "_name_or_path"):
        cfg.pop(k, None)
    return json.dumps(cfg, sort_keys=True, default=str)


def _named_state(model) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer (persistent or not: RoPE's ``inv_freq`` is not in the state
    dict), tied tensors once."""
    return [*model.named_parameters(), *model.named_buffers()]


def weight_checksums(tensors: Sequence[torch.Tensor]) -> list[bytes]:
    """An exact checksum of each tensor's bytes, computed on its device (one host sync in all).

    The bytes are read as int64 words in rows of 64: ``sum(words)`` and ``sum((r + 1) *
    rowsum_r)`` (mod 2^64) detect any change of any bit and any move of data between rows; the
    tail (< 512 bytes) is hashed as is. Integer sums are order-independent, so the result is the
    same on every device. Returns 16 bytes + tail per tensor."""
    sums, tails = [], []
    for t in tensors:
        t = t.detach()
        if t.device.type == "meta":
            raise ChunkStoreError("ragattn.ChunkStore: cannot fingerprint a model with weights on the "
                                  "meta device (offloaded or not materialised)")
        b = t.contiguous().reshape(-1).view(torch.uint8)
        rows = b.numel() // (8 * _WORDS_PER_ROW)
        main = b[: rows * 8 * _WORDS_PER_ROW]
        if main.data_ptr() % 8:
            main = main.clone()
        r = main.view(torch.int64).view(rows, _WORDS_PER_ROW).sum(1)
        w = torch.arange(1, rows + 1, dtype=torch.int64, device=r.device)
        sums.append(torch.stack([r.sum(), (r * w).sum()]))
        tails.append(b[rows * 8 * _WORDS_PER_ROW:])
    if not sums:
        return []
    if len({s.device for s in sums}) == 1:   # one device-to-host copy each (one sync)
        host = torch.stack(sums).cpu().numpy()
        tail_all = torch.cat(tails).cpu().numpy().tobytes()
    else:                                     # a model spread over devices
        host = torch.stack([s.cpu() for s in sums]).numpy()
        tail_all = b"".join(x.cpu().numpy().tobytes() for x in tails)
    out, at = [], 0
    for i, x in enumerate(tails):
        out.append(host[i].tobytes() + tail_all[at: at + x.numel()])
        at += x.numel()
    return out


def _state_versions(named):
    """(id, data_ptr, version) of every tensor, or None when one has no version counter."""
    try:
        return tuple((id(t), t.data_ptr(), t._version) for _, t in named)
    except RuntimeError:  # inference tensors track no version
        return None


def model_fingerprint(model, cached: bool = True) -> str:
    """Hex fingerprint of a model: its config (all but the attention implementation and the path
    it was loaded from) and an exact checksum of every parameter and buffer
    (:func:`weight_checksums`) with names, shapes, dtypes.

    ``cached=True`` reuses the last value while the config and every tensor's identity and
    in-place version counter are unchanged (cheap: for per-request checks); writes that bypass
    the version counter (``p.data.copy_(...)``) are only seen with ``cached=False``, which
    :class:`ChunkStore` uses at creation."""
    named = _named_state(model)
    cfg = _config_json(model)
    state = (cfg, _state_versions(named))
    hit = getattr(model, "_ragattn_fingerprint_cache", None)
    if cached and state[1] is not None and hit is not None and hit[0] == state:
        return hit[1]
    h = hashlib.sha256(cfg.encode())
    for (name, t), digest in zip(named, weight_checksums([t for _, t in named])):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(digest)
    fp = h.hexdigest()[:32]
    model._ragattn_fingerprint_cache = (state, fp)
    return fp


def chunk_key(fingerprint: str, tokens) -> str:
    """``sha256(fingerprint, int64 token bytes)`` (40 hex digits); ``tokens``: ids or an int tensor."""
    t = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    t = np.ascontiguousarray(t.reshape(-1), dtype=np.int64)
    return hashlib.sha256(fingerprint.encode() + t.tobytes()).hexdigest()[:40]


def variant_key(fingerprint: str, key: str, variant: str) -> str:
    return hashlib.sha256(f"{fingerprint}:{key}:{variant}".encode()).hexdigest()[:40]
