"""Trained adapters shipped with ragattn, checked against their manifests and merged into a model.

    from ragattn.hf.adapters import shipped_adapter, tuned_model
    manifest = shipped_adapter("block-attention")   # dict: command, commit, data, hashes (files checked)
    tuned = tuned_model(model)                       # a copy of ``model`` with the LoRA merged in

``block-attention`` is the LoRA adapter of SmolLM2-135M-Instruct trained by
``python -m ragattn finetune`` (``docs/finetune.md``) to answer under the Block-Attention mask as the
model answers under full attention; it serves Block-Attention and TurboRAG (reordered and
composite positions). The tuned model is an ordinary HF model (no peft at run time): the chunk
store keys its chunks by its own weights, so tuned and untuned caches never mix, and it exports to a
folder vLLM serves like any checkpoint.
"""
from __future__ import annotations

import copy
import hashlib
import json
import weakref
from pathlib import Path

import torch

WEIGHTS = Path(__file__).resolve().parents[1] / "weights"
ADAPTERS = {"block-attention": "block-attention-lora", "refrag": "refrag-k16"}   # name -> folder under ragattn/weights
_ARCH_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size")

_TUNED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # model -> {(name, folder, hashes): tuned copy}


class AdapterError(RuntimeError):
    """A shipped adapter is missing, damaged (hash mismatch) or made for another model."""


class AdapterMismatch(AdapterError):
    """The adapter was trained for another model (architecture or weights)."""


def adapter_dir(name: str = "block-attention") -> Path:
    """The folder of shipped adapter ``name`` (``adapter_config.json``, ``adapter_model.safetensors``,
    ``manifest.json``)."""
    if name not in ADAPTERS:
        raise AdapterError(f"ragattn.hf.adapters: unknown adapter {name!r} (shipped: {', '.join(ADAPTERS)})")
    return WEIGHTS / ADAPTERS[name]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shipped_adapter(name: str = "block-attention") -> dict:
    """The manifest of adapter ``name`` after checking every file it lists against its sha256;
    AdapterError when the folder, a file or a hash does not match."""
    d = adapter_dir(name)
    if not (d / "manifest.json").is_file():
        raise AdapterError(f"ragattn.hf.adapters: {d / 'manifest.json'} is missing (adapter {name!r} not shipped "
                           "in this installation)")
    return check_adapter_files(d)


def check_adapter_files(folder: Path) -> dict:
    """The manifest of the adapter in ``folder`` (``manifest.json``) after checking every file it
    lists against its sha256; AdapterError when the manifest or a file is missing or a hash differs."""
    manifest_file = Path(folder) / "manifest.json"
    if not manifest_file.is_file():
        raise AdapterError(f"ragattn.hf.adapters: {manifest_file} is missing")
    manifest = json.loads(manifest_file.read_text())
    for fname, digest in manifest.get("files", {}).items():
        f = Path(folder) / fname
        if not f.is_file():
            raise AdapterError(f"ragattn.hf.adapters: {f} is missing")
        if _sha256(f) != digest:
            raise AdapterError(f"ragattn.hf.adapters: {f} does not match its recorded sha256 {digest[:12]}...")
    return manifest


def architecture(model) -> dict:
    """The config fields an adapter depends on (shapes and family)."""
    return {k: getattr(model.config, k, None) for k in _ARCH_KEYS}


def tuned_model(model, name: str = "block-attention"):
    """A copy of ``model`` (eval mode, same device and dtype) with adapter ``name`` merged into its
    weights; the same copy for repeated calls on the same model and the same shipped files (the cache
    is keyed by the files' hashes, so weights re-shipped or pointed elsewhere are merged afresh). AdapterError when the adapter was
    trained for another architecture, or, for a float32 model, for other weights (the manifest's
    ``base_fingerprint``, :func:`ragattn.store.fingerprint.model_fingerprint`)."""
    manifest = shipped_adapter(name)
    key = (name, str(adapter_dir(name)), tuple(sorted(manifest.get("files", {}).items())))
    per_model = _TUNED.setdefault(model, {})
    if key in per_model:
        return per_model[key]
    if manifest.get("architecture") and architecture(model) != manifest["architecture"]:
        raise AdapterMismatch(f"ragattn.hf.adapters: adapter {name!r} was trained for {manifest['base_model']} "
                           f"({manifest['architecture']}), not for this model ({architecture(model)})")
    if manifest.get("base_fingerprint") and next(model.parameters()).dtype == torch.float32:
        from ragattn.store.fingerprint import model_fingerprint

        if model_fingerprint(model) != manifest["base_fingerprint"]:
            raise AdapterMismatch(f"ragattn.hf.adapters: adapter {name!r} was trained on other weights "
                               f"({manifest['base_model']}); this model's fingerprint differs")
    from peft import PeftModel

    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    tuned = PeftModel.from_pretrained(copy.deepcopy(model), str(adapter_dir(name))).merge_and_unload()
    tuned = tuned.to(dtype=dtype, device=device).eval()
    tuned.config.ragattn_adapter = name
    per_model[key] = tuned
    return tuned
