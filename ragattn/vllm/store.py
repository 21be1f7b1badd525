"""The served model as the worker's chunk store sees it, for the vLLM connector (free of vLLM).

The connector keys chunks with the same fingerprint as the HF path
(:func:`ragattn.store.model_fingerprint`: config and an exact checksum of every weight). It computes
it from the served checkpoint's files (:mod:`ragattn.vllm.fingerprint`: the model built with empty
parameters, each weight's checksum streamed from its safetensors file), so no process holds a copy
of the weights, and describes the model to the store (:class:`ragattn.store.ChunkModel`: dimensions
from the config, RoPE from the empty model's real buffers, no prefill: the worker's store serves
chunk files only); neither the empty model nor a loaded one is kept. Checkpoints whose files do not
hold the parameters under the model's names (renamed, quantised, not safetensors) fall back to
loading the model on the CPU, with a warning, for the fingerprint and the description. A chunk
directory built for another model is refused at start-up.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ragattn.hf.store_model import describe
from ragattn.store import FORMAT, ChunkModel, ChunkStoreError, model_fingerprint

log = logging.getLogger(f"vllm.{__name__}")   # vLLM's logger tree (configured in a vLLM process), no import of vLLM
_DESCRIPTIONS: dict[tuple[str, torch.dtype], ChunkModel] = {}
_SAMPLE = 64   # chunk files whose header is read at start-up


def served_chunk_model(path: str | os.PathLike, dtype: torch.dtype) -> ChunkModel:
    """The HF checkpoint at ``path`` served in ``dtype`` as a chunk-store description (once per
    process and path): its fingerprint, dimensions and RoPE; the pool on the CPU (chunk K/V in host
    memory, staged to the caches' device); no prefill and no reference to a model."""
    key = (str(path), dtype)
    if key not in _DESCRIPTIONS:
        from ragattn.vllm.fingerprint import FingerprintUnavailable, checkpoint_fingerprint

        try:
            fp, model = checkpoint_fingerprint(path, dtype, return_model=True)
            _DESCRIPTIONS[key] = describe(model, fp, "cpu", keep_model=False)
            return _DESCRIPTIONS[key]
        except FingerprintUnavailable as exc:
            log.warning("ragattn.vllm: %s; loading the model on the CPU to fingerprint it", exc)
        except (OSError, ValueError) as exc:
            raise ChunkStoreError(f"ragattn.vllm: cannot read the served model at {path} to fingerprint it ({exc}); "
                                  "set kv_connector_extra_config 'hf_model' to the HF folder the chunk store was "
                                  "built from") from exc
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
        except (OSError, ValueError) as exc:
            raise ChunkStoreError(f"ragattn.vllm: cannot load the served model from {path} with transformers to "
                                  f"fingerprint it ({exc}); set kv_connector_extra_config 'hf_model' to the HF "
                                  "folder the chunk store was built from") from exc
        _DESCRIPTIONS[key] = describe(model, model_fingerprint(model, cached=False), "cpu", keep_model=False)
    return _DESCRIPTIONS[key]


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
