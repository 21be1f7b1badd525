"""The served model's chunk-store identity, for the vLLM connector (free of vLLM).

The connector keys chunks with the same fingerprint as the HF path
(:func:`ragattn.methods.chunk_store.model_fingerprint`: config and an exact checksum of every
weight), so it loads the served checkpoint once per process with transformers, on the CPU, to
compute it; the worker's chunk store keeps that model for its RoPE parameters (and for nothing
on the hot path). A chunk directory built for another model is refused at start-up.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ragattn.methods.chunk_store import FORMAT, ChunkStoreError, model_fingerprint

_MODELS: dict[tuple[str, torch.dtype], tuple[object, str]] = {}
_SAMPLE = 64   # chunk files whose header is read at start-up


def served_model(path: str | os.PathLike, dtype: torch.dtype):
    """``(model, fingerprint)`` of the HF checkpoint at ``path`` loaded in ``dtype`` on the CPU
    (once per process and path)."""
    key = (str(path), dtype)
    if key not in _MODELS:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
        except (OSError, ValueError) as exc:
            raise ChunkStoreError(f"ragattn.vllm: cannot load the served model from {path} with transformers to "
                                  f"fingerprint it ({exc}); set kv_connector_extra_config 'hf_model' to the HF "
                                  "folder the chunk store was built from") from exc
        _MODELS[key] = (model, model_fingerprint(model, cached=False))
    return _MODELS[key]


def directory_fingerprints(directory: str | os.PathLike, limit: int = _SAMPLE) -> set[str]:
    """Model fingerprints named by (up to ``limit``) chunk files in ``directory`` (headers only)."""
    from safetensors import safe_open

    found = set()
    for i, p in enumerate(sorted(Path(directory).glob("*.safetensors"))):
        if i >= limit:
            break
        try:
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception:   # a corrupt file is refused when a request needs it
            continue
        if meta.get("format") == FORMAT and meta.get("fingerprint"):
            found.add(meta["fingerprint"])
    return found


def check_directory_fingerprint(directory: str | os.PathLike, fingerprint: str) -> None:
    """ChunkStoreError when ``directory``'s chunk files were all built for other models."""
    found = directory_fingerprints(directory)
    if found and fingerprint not in found:
        raise ChunkStoreError(f"ragattn.vllm: the chunk files in {directory} were built for model fingerprint(s) "
                              f"{sorted(found)}, the served model's is {fingerprint!r} (another checkpoint, dtype "
                              "or config): rebuild the store with this model")
