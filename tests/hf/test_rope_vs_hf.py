"""ragattn's re-rotation against HuggingFace's own rotary embeddings.

Keys are rotated at position p with a family's own rotary module and apply_rotary_pos_emb,
re-rotated by delta with ragattn (inv_freq taken from the HF module), and compared with
transformers at p + delta. Positions are powers of two (plus small ones): there HF's fp32
product position * inv_freq is exact, so HF itself is exact up to 2^20 and the comparison
isolates ragattn's rotation (fp32 caches: within 1e-4 relative).
"""
from __future__ import annotations

import pytest
import torch

import ragattn
from tests.helpers import max_abs_err, randn_nonzero

transformers = pytest.importorskip("transformers")

# (p, p + delta): powers of two up to 2^20 both ways, and small arbitrary positions
PAIRS = [(1, 1 << 20), (1 << 20, 2), (1 << 12, 1 << 17), (1 << 19, 1 << 13), (0, 1 << 16), (3, 45), (40, 7), (8, 8)]


def _hf_neox(module_name, config, positions, k):
    """k [1, H, S, D] rotated with the family's rotary module + apply_rotary_pos_emb at positions [S]."""
    mod = __import__(f"transformers.models.{module_name}.modeling_{module_name}", fromlist=["x"])
    rot_cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding"))
    rot = rot_cls(config=config)
    assert rot.attention_scaling == 1.0  # contract: no attention scaling applied again
    cos, sin = rot(k, positions[None])
    rd = cos.shape[-1]
    if rd == k.shape[-1]:
        _, out = mod.apply_rotary_pos_emb(k, k, cos, sin)
    else:  # families whose attention splits the rotary part off before apply_rotary_pos_emb
        _, kr = mod.apply_rotary_pos_emb(k[..., :rd], k[..., :rd], cos, sin)
        out = torch.cat((kr, k[..., rd:]), dim=-1)
    return out, rot.inv_freq.float(), rd


def _configs():
    from transformers import GPTNeoXConfig, LlamaConfig, PhiConfig, Qwen2Config

    common = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 21)
    return {
        "llama3": (
            "llama",
            LlamaConfig(
                head_dim=64,
                rope_parameters={
                    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                },
                **common,
            ),
        ),
        "qwen2": ("qwen2", Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **common)),
        "gpt_neox_partial": (
            "gpt_neox",
            GPTNeoXConfig(
                hidden_size=256, num_attention_heads=4, max_position_embeddings=1 << 21,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            ),
        ),
        "phi_partial": (
            "phi",
            PhiConfig(
                hidden_size=256, num_attention_heads=4, max_position_embeddings=1 << 21,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            ),
        ),
    }


@pytest.mark.parametrize("family", ["llama3", "qwen2", "gpt_neox_partial", "phi_partial"])
def test_neox_families_match_hf(device, seed, family):
    module_name, config = _configs()[family]
    heads, head_dim = 2, 64
    n = len(PAIRS)
    k = randn_nonzero(1, heads, n, head_dim)
    p = torch.tensor([a for a, _ in PAIRS])
    q = torch.tensor([b for _, b in PAIRS])
    at_p, inv_freq, rd = _hf_neox(module_name, config, p, k)
    at_q, _, _ = _hf_neox(module_name, config, q, k)
    assert rd < head_dim if "partial" in family else rd == head_dim
    cache = at_p[0].transpose(0, 1).contiguous().to(device)  # [rows, heads, head_dim]
    ragattn.rerotate_keys_([cache], torch.arange(n, device=device), (q - p).int().to(device), inv_freq.to(device), rd, False)
    want = at_q[0].transpose(0, 1)
    assert max_abs_err(cache.cpu(), want) <= 1e-4 * float(want.abs().max()), family
    # copy_kv_ with fused rotation gives the same keys
    dst = torch.full_like(cache, float("nan"))
    src = at_p[0].transpose(0, 1).contiguous().to(device)
    v = randn_nonzero(n, heads, head_dim, device=device)
    dv = torch.full_like(v, float("nan"))
    ragattn.copy_kv_([dst], [dv], [src], [v], torch.arange(n, device=device), torch.arange(n, device=device),
                     (q - p).int().to(device), inv_freq.to(device), rd, False)
    assert max_abs_err(dst.cpu(), want) <= 1e-4 * float(want.abs().max())
    assert torch.equal(dv, v)


def test_gptj_interleaved_matches_hf(device, seed):
    from transformers.models.gptj import modeling_gptj as gptj

    rotary_dim, head_dim, heads, num_pos = 32, 64, 3, (1 << 13) + 1
    table = gptj.create_sinusoidal_positions(num_pos, rotary_dim)  # [pos, rotary_dim]: sin | cos
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64) / rotary_dim))  # as GPT-J builds it
    pairs = [(1, 1 << 13), (1 << 13, 4), (1 << 10, 1 << 12), (5, 77), (100, 3)]
    k = randn_nonzero(1, len(pairs), heads, head_dim)  # GPT-J applies RoPE on [B, S, H, D]

    def hf_at(pos):
        sincos = table[pos][None]  # [1, S, rotary_dim]
        sin, cos = torch.split(sincos, rotary_dim // 2, dim=-1)
        kr = gptj.apply_rotary_pos_emb(k[..., :rotary_dim], sin, cos)
        return torch.cat((kr, k[..., rotary_dim:]), dim=-1)[0]

    p = torch.tensor([a for a, _ in pairs])
    q = torch.tensor([b for _, b in pairs])
    cache = hf_at(p).contiguous().to(device)
    ragattn.rerotate_keys_([cache], torch.arange(len(pairs), device=device), (q - p).int().to(device),
                           inv_freq.float().to(device), rotary_dim, True)
    want = hf_at(q)
    assert max_abs_err(cache.cpu(), want) <= 1e-4 * float(want.abs().max())
    # the NeoX layout would be wrong here: the comparison can fail
    wrong = hf_at(p).contiguous().to(device)
    ragattn.rerotate_keys_([wrong], torch.arange(len(pairs), device=device), (q - p).int().to(device),
                           inv_freq.float().to(device), rotary_dim, False)
    assert max_abs_err(wrong.cpu(), want) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_caches_match_hf(device, seed, dtype):
    """bf16/fp16 caches: ragattn's one rounding vs HF's fp32 result at p + delta."""
    module_name, config = _configs()["llama3"]
    n = len(PAIRS)
    k = randn_nonzero(1, 2, n, 64)
    p = torch.tensor([a for a, _ in PAIRS])
    q = torch.tensor([b for _, b in PAIRS])
    at_p, inv_freq, rd = _hf_neox(module_name, config, p, k)
    at_q, _, _ = _hf_neox(module_name, config, q, k)
    cache = at_p[0].transpose(0, 1).contiguous().to(device=device, dtype=dtype)
    ragattn.rerotate_keys_([cache], torch.arange(n, device=device), (q - p).int().to(device), inv_freq.to(device), rd, False)
    want = at_q[0].transpose(0, 1)
    eps = torch.finfo(dtype).eps
    # input rounding (one ulp, rotated) + output rounding (half an ulp) of values up to max|k|
    assert max_abs_err(cache.float().cpu(), want) <= 3 * eps * float(want.abs().max())
