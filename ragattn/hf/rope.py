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

# model_type -> interleaved layout. Every family here applies rotate_half (NeoX halves) to the first
# rotary_dim dims (Phi-3: partial_rotary_factor; Gemma 2/3: soft-capping, alternating sliding layers,
# head_dim 256, query_pre_attn_scalar are the attention's, see ragattn.hf.attention).
SUPPORTED_FAMILIES = {"llama": False, "qwen2": False, "mistral": False, "qwen3": False, "gemma2": False,
                      "gemma3_text": False, "phi3": False}


@dataclass(frozen=True)
class _OneRope:
    """A per-layer-type rotary module whose layer types all share one RoPE."""
    inv_freq: torch.Tensor
    attention_scaling: float
    rope_type: str


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
        types = getattr(m, "layer_types", None)
        if types and all(isinstance(getattr(m, f"{t}_inv_freq", None), torch.Tensor) for t in types):
            # one RoPE per layer type (Gemma 3: local base for sliding layers, global for full ones)
            freqs = [getattr(m, f"{t}_inv_freq") for t in types]
            if any(f.shape != freqs[0].shape or not torch.equal(f, freqs[0]) for f in freqs[1:]):
                raise NotImplementedError(
                    f"ragattn.hf.rope: {type(model).__name__} rotates its {', '.join(types)} layers with different "
                    "RoPE frequencies (e.g. Gemma 3's rope_local_base_freq); re-rotating cached keys needs one "
                    "frequency set for every layer: the cached-chunk methods do not support it (the ragattn "
                    "attention itself does)")
            scalings = {float(getattr(m, f"{t}_attention_scaling", 1.0) or 1.0) for t in types}
            return _OneRope(freqs[0], scalings.pop() if len(scalings) == 1 else float("nan"),
                            getattr(m, "rope_type", {}).get(types[0], "default"))
    raise ValueError(f"ragattn.hf.rope: no rotary embedding module (with inv_freq) found in "
                     f"{type(model).__name__}")


def rope_params(model) -> RopeParams:
    """RoPE parameters of ``model`` (a ``*ForCausalLM`` of :data:`SUPPORTED_FAMILIES` or its base model);
    ``rotary_dim < head_dim`` for partial rotary (Phi-3's ``partial_rotary_factor``)."""
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
