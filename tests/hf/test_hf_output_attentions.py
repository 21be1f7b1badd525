"""``output_attentions=True`` under the "ragattn" attention: the call runs the model's
eager attention, so code written for SDPA/eager runs unchanged. transformers' own model tests
(tests/models/*/test_modeling_*.py) are not shipped in its wheel, so these are ours, after the
three that failed there: test_capture_outputs_decorator (attentions captured per layer),
test_eager_matches_sdpa_inference_*_fp32_pad_left_output_attentions (logits vs eager, left
padding) and test_model_outputs_equivalence (tuple == dict outputs)."""
import pytest
import torch

import ragattn.hf  # noqa: F401  (registers "ragattn")
from ragattn.hf.registration import use_ragattn
from ragattn.kv import PagedKV
from ragattn.hf.models import random_llama

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, rope_theta=1000.0)
FAMILIES = ["llama", "qwen2", "mistral"]


def _model(family):
    over = dict(sliding_window=5) if family == "mistral" else {}
    model = random_llama(dict(SHAPE, **over), dtype=torch.float32, family=family, seed=3)
    model.generation_config.pad_token_id = 0
    return model


def _padded_left(batch=3, n=9):
    ids = torch.randint(1, 97, (batch, n), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    if batch > 2:
        mask[2, :6] = 0
    return ids, mask


def _run(model, impl, **kw):
    model.set_attn_implementation(impl)
    try:
        with torch.no_grad():
            return model(**kw)
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("family", FAMILIES)
def test_output_attentions_equal_eager(family):
    model = _model(family)
    ids, mask = _padded_left()
    for kw in (dict(input_ids=ids, attention_mask=mask), dict(input_ids=ids[:1])):   # padded; mask-free
        ref = _run(model, "eager", output_attentions=True, **kw)
        got = _run(model, "ragattn", output_attentions=True, **kw)
        assert got.attentions is not None and len(got.attentions) == SHAPE["num_hidden_layers"]
        for a, b in zip(got.attentions, ref.attentions):
            assert a.shape == (kw["input_ids"].shape[0], SHAPE["num_attention_heads"], ids.shape[1], ids.shape[1])
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        real = kw.get("attention_mask", torch.ones_like(kw["input_ids"])).bool()
        torch.testing.assert_close(got.logits[real], ref.logits[real], rtol=1e-5, atol=1e-5)
        # the same logits as ragattn without output_attentions (a padded query row is undefined)
        plain = _run(model, "ragattn", **kw)
        torch.testing.assert_close(got.logits[real], plain.logits[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_equivalence_tuple_and_dict(family):
    model = _model(family)
    ids, mask = _padded_left()
    kw = dict(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    as_dict = _run(model, "ragattn", return_dict=True, **kw)
    as_tuple = _run(model, "ragattn", return_dict=False, **kw)
    flat_dict = [t for v in as_dict.to_tuple() for t in (v if isinstance(v, tuple) else (v,))
                 if isinstance(t, torch.Tensor)]
    flat_tuple = [t for v in as_tuple for t in (v if isinstance(v, tuple) else (v,)) if isinstance(t, torch.Tensor)]
    assert len(flat_dict) == len(flat_tuple) > 0
    for a, b in zip(flat_dict, flat_tuple):
        assert torch.equal(a, b)


def test_generate_with_output_attentions_equals_eager():
    """Decode steps too (q == 1 over a dynamic cache): per-step attentions and tokens as eager's."""
    model = _model("llama")
    ids, mask = _padded_left(batch=2)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False,
              output_attentions=True, return_dict_in_generate=True)
    outs = {}
    for impl in ("eager", "ragattn"):
        model.set_attn_implementation(impl)
        outs[impl] = model.generate(**kw)
    model.set_attn_implementation("sdpa")
    assert torch.equal(outs["eager"].sequences, outs["ragattn"].sequences)
    for step_ref, step_got in zip(outs["eager"].attentions, outs["ragattn"].attentions):
        for a, b in zip(step_got, step_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_output_attentions_refused_on_ragattn_inputs():
    model = _model("llama")
    cache = PagedKV(2, 1, 16, 2, 16, page_size=4)
    with use_ragattn(model), torch.no_grad(), pytest.raises(NotImplementedError, match="output_attentions"):
        model(torch.randint(1, 97, (1, 5)), ragattn_paged=cache, output_attentions=True)
