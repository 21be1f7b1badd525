"""The served model's chunk-store fingerprint from its checkpoint files, without loading the weights.

:func:`ragattn.store.model_fingerprint` hashes the model's config and an exact checksum
of every parameter and buffer (:func:`~ragattn.store.weight_checksums`). A vLLM process
used to load a full CPU copy of the weights to compute it (2 x 140 GB of host memory for a 70B bf16
model across scheduler and worker). :func:`checkpoint_fingerprint` computes the same value from the
files: the model is built with empty (meta) parameters and real buffers (RoPE's ``inv_freq``), the
config and every name / shape / dtype come from it, and each parameter's checksum is streamed from
its safetensors file (header parsed for the byte range, bytes read in blocks, converted to the served
dtype first when the file holds another). Memory: one read block. The HF path gives the identical
fingerprint for the same weights (tests/vllm/test_fingerprint.py compares them).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from ragattn.store.errors import ChunkStoreError
from ragattn.store.fingerprint import TensorChecksum, _config_json, weight_checksums

_BLOCK = 64 << 20                   # bytes read at a time (a multiple of every dtype's size)

# safetensors dtype names -> torch dtypes
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class FingerprintUnavailable(ChunkStoreError):
    """The checkpoint files do not hold the model's parameters under its own names (renamed,
    quantised or non-safetensors checkpoints): the fingerprint needs the loaded model."""


# The checksum of a tensor whose bytes arrive in pieces (a file read block by block): the store's
# own TensorChecksum, so that both paths compute one value by one definition.
StreamedChecksum = TensorChecksum


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FingerprintUnavailable(f"ragattn.vllm: no safetensors checkpoint in {path}")
    return files


def safetensors_header(file: Path) -> tuple[int, dict]:
    """``(data_start, {name: {"dtype", "shape", "data_offsets"}})`` of a safetensors file (header only)."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def _tensor_digest(file: Path, start: int, info: dict, dtype: torch.dtype) -> bytes:
    """The checksum of one stored tensor as ``dtype`` (converted in blocks when it is stored in another)."""
    src = _ST_DTYPES.get(info["dtype"])
    if src is None:
        raise FingerprintUnavailable(f"ragattn.vllm: {file.name} stores a tensor as {info['dtype']}")
    a, b = info["data_offsets"]
    c = StreamedChecksum()
    item = src.itemsize
    with open(file, "rb") as f:
        f.seek(start + a)
        left = b - a
        while left:
            data = f.read(min(_BLOCK - _BLOCK % item, left))
            if not data:
                raise FingerprintUnavailable(f"ragattn.vllm: {file} is truncated")
            left -= len(data)
            if src != dtype:
                data = torch.frombuffer(bytearray(data), dtype=src).to(dtype).view(torch.uint8).numpy()
            c.update(data)
    return c.digest()


def checkpoint_fingerprint(path: str | os.PathLike, dtype: torch.dtype, *, return_model: bool = False):
    """:func:`~ragattn.store.model_fingerprint` of the HF checkpoint at ``path`` loaded in
    ``dtype``, computed from its files (see the module docstring). ``return_model``: also return the
    empty model (meta parameters, real buffers: config and RoPE parameters for a chunk store).
    Raises FingerprintUnavailable when a parameter is not in the files under its name."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.tie_weights()  # tied parameters are one parameter, listed once (as in the loaded model)
    model.config.dtype = dtype  # as from_pretrained(dtype=...) records it
    where: dict[str, tuple[Path, int, dict]] = {}
    for file in _safetensors_files(path):
        start, header = safetensors_header(file)
        for name, info in header.items():
            where[name] = (file, start, info)
    named = [*model.named_parameters(), *model.named_buffers()]
    h = hashlib.sha256(_config_json(model).encode())
    for name, t in named:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        if t.device.type != "meta":  # a buffer built by the model (inv_freq): as the HF path sees it
            h.update(weight_checksums([t])[0])
            continue
        if name not in where:
            raise FingerprintUnavailable(f"ragattn.vllm: parameter {name} is not in the checkpoint files of {path} "
                                         "under that name")
        file, start, info = where[name]
        if tuple(info["shape"]) != tuple(t.shape):
            raise FingerprintUnavailable(f"ragattn.vllm: {name} is {info['shape']} in {file.name}, the model "
                                         f"expects {list(t.shape)}")
        h.update(_tensor_digest(file, start, info, t.dtype))
    fp = h.hexdigest()[:32]
    return (fp, model) if return_model else fp


__all__ = ["checkpoint_fingerprint", "safetensors_header", "StreamedChecksum", "FingerprintUnavailable"]
