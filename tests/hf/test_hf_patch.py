import pytest
import torch

import ragattn.hf.attention  # noqa: F401  (registers "ragattn")
from ragattn.hf.models import random_llama


def _generate(model, enc, impl, n=6):
    model.set_attn_implementation(impl)
    try:
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    finally:
        model.set_attn_implementation("sdpa")
    return out[:, enc["input_ids"].shape[1]:]


def test_smollm2_generation_equals_sdpa_padded_batch(smollm2):
    model, tok = smollm2
    tok.padding_side = "left"
    enc = tok(["The capital of France is", "Name three colours of the rainbow, then explain:",
               "Hi"], return_tensors="pt", padding=True)
    assert (enc["attention_mask"] == 0).any()  # the batch really is padded
    ref = _generate(model, enc, "sdpa")
    got = _generate(model, enc, "ragattn")
    assert torch.equal(ref, got)


def test_smollm2_logits_close_to_sdpa(smollm2):
    model, tok = smollm2
    ids = tok("Retrieval augmented generation reads documents.", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model(ids).logits
        model.set_attn_implementation("ragattn")
        try:
            got = model(ids).logits
        finally:
            model.set_attn_implementation("sdpa")
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("family", ["qwen2", "mistral", "llama"])
def test_tiny_families_generation_equals_sdpa(family):
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, rope_theta=1000.0)
    model = random_llama(shape, dtype=torch.float32, family=family, seed=3)
    model.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 97, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :9] = 0
    enc = {"input_ids": ids, "attention_mask": mask}
    assert torch.equal(_generate(model, enc, "sdpa", 8), _generate(model, enc, "ragattn", 8))


def test_block_ids_give_block_attention_mask():
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, rope_theta=1000.0)
    model = random_llama(shape, dtype=torch.float32, seed=5)
    ids = torch.randint(1, 97, (1, 12))
    blocks = torch.tensor([[0] * 5 + [1] * 4 + [-1] * 3])
    allow = torch.ones(12, 12).tril().bool()
    allow &= (blocks[0][:, None] == blocks[0][None]) | (blocks[0][:, None] == -1)
    with torch.no_grad():
        ref = model(ids, attention_mask=torch.where(allow, 0.0, float("-inf"))[None, None]).logits
        model.set_attn_implementation("ragattn")
        got = model(ids, ragattn_block_ids=blocks).logits
        plain = model(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert (plain - ref).abs().max() > 1e-3


def test_paged_batch_prefill_then_decode_equals_plain_forward():
    """ragattn_paged with B = 2: a prefill and a decode step through the paged request cache give
    the logits of one plain forward over the same tokens; a cache that would overflow is refused."""
    from ragattn.hf.registration import use_ragattn
    from ragattn.kv import PagedKV

    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=101, max_position_embeddings=256, rope_theta=1000.0)
    model = random_llama(shape, dtype=torch.float32, seed=3)
    ids = torch.randint(1, 101, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(ids).logits
        cache = PagedKV(2, 2, 7, 2, 16, page_size=4)  # 2 pages of 4 slots per row
        assert cache.capacity == 8
        with use_ragattn(model):
            pre = model(input_ids=ids[:, :5], position_ids=torch.arange(5)[None].expand(2, 5),
                        use_cache=False, ragattn_paged=cache).logits
            cache.lengths += 5
            dec = model(input_ids=ids[:, 5:], position_ids=torch.full((2, 1), 5), use_cache=False,
                        ragattn_paged=cache).logits
            cache.lengths += 1
            with pytest.raises(ValueError, match="cache full"):
                model(input_ids=ids[:, :3], position_ids=torch.tensor([[6, 7, 8]] * 2), use_cache=False,
                      ragattn_paged=cache)
    torch.testing.assert_close(torch.cat([pre, dec], dim=1), ref, rtol=1e-4, atol=1e-4)


def test_use_ragattn_replays_the_switch_and_follows_user_changes():
    """The second and later switches write the values transformers wrote the first time (no walk
    over the modules); a switch made by the user in between is honoured, never undone."""
    from unittest import mock

    from ragattn.hf.registration import use_ragattn

    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, rope_theta=1000.0)
    model = random_llama(shape, dtype=torch.float32, seed=3)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(1, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    real = type(model).set_attn_implementation
    with mock.patch.object(type(model), "set_attn_implementation", autospec=True, side_effect=real) as calls:
        seen = []
        for _ in range(3):
            with use_ragattn(model), torch.no_grad():
                seen.append((model.config._attn_implementation, model.model.config._attn_implementation))
                got = model(input_ids=ids).logits
            assert model.config._attn_implementation == "sdpa"
        assert seen == [("ragattn", "ragattn")] * 3
        assert calls.call_count == 2   # on and off, once each
        assert torch.allclose(got, want, atol=1e-5)
        model.set_attn_implementation("eager")   # the user's own switch: a new pair, real calls
        for _ in range(2):
            with use_ragattn(model):
                assert model.config._attn_implementation == "ragattn"
            assert model.config._attn_implementation == "eager"
        assert calls.call_count == 2 + 1 + 2
