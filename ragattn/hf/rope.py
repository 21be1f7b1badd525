"""Per-family RoPE parameters read from a loaded HF model (the ragattn RoPE convention).

    from ragattn.hf.rope import rope_params
    p = rope_params(model)      # RopeParams(inv_freq fp32 [rotary_dim // 2], rotary_dim, interleaved)
    ragattn.rerotate_keys_(k_layers, rows, delta, p.inv_freq, p.rotary_dim, p.interleaved)

``inv_freq`` is taken from the model's own rotary-embedding module, so it carries every HF
scaling variant (llama3, linear, yarn frequencies). Re-rotating a cached key is exact only when
HF's cos/sin are not multiplied by an attention factor (``attention_scaling == 1``) and the
frequencies do not depend on the sequence length (no dynamic NTK): both are refused clearly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# model_type -> interleaved layout. Llama, Qwen2 and Mistral apply rotate_half (NeoX halves).
SUPPORTED_FAMILIES = {"llama": False, "qwen2": False, "mistral": False, "qwen3": False}


@dataclass(frozen=True)
class RopeParams:
    inv_freq: torch.Tensor  # float32 [rotary_dim // 2]
    rotary_dim: int
    interleaved: bool
    head_dim: int


def model_family(model) -> str:
    config = getattr(model, "config", model)
    return getattr(config, "model_type", type(model).__name__)


def check_supported(model) -> str:
    fam = model_family(model)
    if fam not in SUPPORTED_FAMILIES:
        raise NotImplementedError(
            f"ragattn.hf: model family {fam!r} is not supported (supported: "
            f"{sorted(SUPPORTED_FAMILIES)}); its RoPE layout and attention module are unknown")
    return fam


def _rotary_module(model):
    for m in model.modules():
        if hasattr(m, "inv_freq") and isinstance(getattr(m, "inv_freq"), torch.Tensor):
            return m
    raise ValueError(f"ragattn.hf.rope: no rotary embedding module (with inv_freq) found in "
                     f"{type(model).__name__}")


def rope_params(model) -> RopeParams:
    """RoPE parameters of ``model`` (a Llama/Qwen2/Mistral ``*ForCausalLM`` or its base model)."""
    fam = check_supported(model)
    config = model.config
    rot = _rotary_module(model)
    scaling = float(getattr(rot, "attention_scaling", 1.0) or 1.0)
    if scaling != 1.0:
        raise ValueError(
            f"ragattn.hf.rope: {fam} model has RoPE attention_scaling={scaling} (e.g. yarn/longrope "
            "mscale); cached keys cannot be re-rotated exactly, expected attention_scaling == 1")
    rope_type = getattr(rot, "rope_type", "default")
    if "dynamic" in str(rope_type):
        raise ValueError(f"ragattn.hf.rope: {fam} model uses {rope_type!r} RoPE whose frequencies "
                         "depend on the sequence length; re-rotation would not be exact")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = rot.inv_freq.detach().to(torch.float32)
    rotary_dim = 2 * inv_freq.numel()
    if rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(f"ragattn.hf.rope: rotary_dim {rotary_dim} does not fit head_dim {head_dim}")
    return RopeParams(inv_freq=inv_freq.contiguous(), rotary_dim=rotary_dim,
                      interleaved=SUPPORTED_FAMILIES[fam], head_dim=head_dim)
