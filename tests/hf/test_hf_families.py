"""Gemma 2, Gemma 3 and Phi-3 under the "ragattn" attention: attention soft-capping
(``logits_soft_cap``), alternating sliding-window layers, head_dim 256, query_pre_attn_scalar,
partial rotary (Phi-3) against the models' eager attention on tiny random configs (prefill,
padded batches, generate with a dynamic cache), the chunk store's exactness and the cached-chunk
methods on them, and the families that remain refused at load time with a hint that works."""
import warnings

import pytest
import torch

import ragattn.hf  # noqa: F401  (registers "ragattn")
from ragattn.hf.registration import use_ragattn
from ragattn.hf.rope import rope_params

VOCAB = 97
LAYERS3 = ["sliding_attention", "full_attention", "sliding_attention"]


def _build(family, **over):
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, Phi3Config,
                              Phi3ForCausalLM)

    common = dict(hidden_size=64, intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "gemma2":
        cfg = Gemma2Config(**common, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                           sliding_window=5, query_pre_attn_scalar=48, attn_logit_softcapping=3.0,
                           final_logit_softcapping=20.0, layer_types=LAYERS3)
        cls = Gemma2ForCausalLM
    elif family == "gemma3":
        cfg = Gemma3TextConfig(**common, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=256, sliding_window=5, query_pre_attn_scalar=48, layer_types=LAYERS3)
        cls = Gemma3ForCausalLM
    else:
        cfg = Phi3Config(**common, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         partial_rotary_factor=0.5)
        cls = Phi3ForCausalLM
    for k, v in over.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls._from_config(cfg, attn_implementation="eager")
    with torch.no_grad():   # larger weights than the init: scores reach the soft cap
        for name, p in model.named_parameters():
            if "proj" in name:
                p.mul_(4.0)
    model.generation_config.pad_token_id = 0
    return model.eval()


FAMILIES = ["gemma2", "gemma3", "phi3"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return _build(request.param)


def _inputs(batch=2, n=13):
    ids = torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[-1, :4] = 0
    return ids, mask


def _logits(model, impl, **kw):
    model.set_attn_implementation(impl)
    try:
        with torch.no_grad():
            return model(**kw).logits
    finally:
        model.set_attn_implementation("eager")


def test_prefill_matches_eager(model):
    for batch in (1, 2):
        ids, mask = _inputs(batch)
        ref = _logits(model, "eager", input_ids=ids, attention_mask=mask)
        got = _logits(model, "ragattn", input_ids=ids, attention_mask=mask)
        real = mask.bool()
        torch.testing.assert_close(got[real], ref[real], rtol=1e-4, atol=1e-4)


def test_generate_matches_eager(model):
    ids, mask = _inputs(2)
    outs = {}
    for impl in ("eager", "ragattn"):
        model.set_attn_implementation(impl)
        outs[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                                    do_sample=False, output_logits=True, return_dict_in_generate=True)
    model.set_attn_implementation("eager")
    assert torch.equal(outs["eager"].sequences, outs["ragattn"].sequences)
    for a, b in zip(outs["ragattn"].logits, outs["eager"].logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_soft_cap_and_shapes_are_exercised(model):
    """What these configs stand for: a soft cap that changes the scores (Gemma 2), head_dim 256 and a
    query_pre_attn_scalar scale (Gemma), sliding layers beside full ones, partial rotary (Phi-3)."""
    family = model.config.model_type
    if family == "gemma2":
        ids, mask = _inputs(1)
        ref = _logits(model, "eager", input_ids=ids)
        model.config.attn_logit_softcapping = None
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        try:
            uncapped = _logits(model, "eager", input_ids=ids)
        finally:
            model.config.attn_logit_softcapping = 3.0
            for layer in model.model.layers:
                layer.self_attn.attn_logit_softcapping = 3.0
        assert (uncapped - ref).abs().max() > 1e-2
    if family.startswith("gemma"):
        assert model.config.head_dim == 256 and model.model.layers[0].self_attn.scaling == 48 ** -0.5
        assert [layer.self_attn.sliding_window for layer in model.model.layers] == [5, None, 5]
    else:
        p = rope_params(model)
        assert p.rotary_dim == (model.config.hidden_size // model.config.num_attention_heads) // 2 == p.head_dim // 2


# ----- the chunk store on these families ---------------------------------------------------------
def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[PAD]", "[EOS]"] + [f"w{i}" for i in range(VOCAB - 3)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")


def _store_model(family):
    """The family's tiny model with a window longer than the tests' prompts: the reference is one
    forward under a custom 4D mask, which transformers applies as given to sliding layers too."""
    if family == "gemma2":
        return _build("gemma2", sliding_window=512)
    if family == "gemma3":   # one RoPE for every layer: re-rotation is exact
        model = _build("gemma3", sliding_window=512)
        model.config.rope_parameters["sliding_attention"]["rope_theta"] = 1e6
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
        model.model.rotary_emb = Gemma3RotaryEmbedding(model.config)
        return model
    return _build(family)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("positions", ["reordered", "composite"])
@pytest.mark.parametrize("zero_copy", [False, True])
def test_chunk_store_exact_on_family(family, positions, zero_copy):
    """Cached chunks + re-rotation + the final block through the paged cache == one eager forward
    of the whole prompt under the Block-Attention mask (test_methods_exactness's rule)."""
    from ragattn.store import ChunkStore
    from tests.methods.test_methods_exactness import _cached_logits, _reference_logits

    model = _store_model(family)
    g = torch.Generator().manual_seed(3)
    blocks = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (6, 11, 3, 9)]
    final = torch.randint(3, VOCAB, (5,), generator=g).tolist()
    store = ChunkStore(model)
    ref = _reference_logits(model, blocks, final, positions)   # eager (the model's implementation)
    got = _cached_logits(model, store, blocks, final, positions, zero_copy=zero_copy)
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4, rel


@pytest.mark.parametrize("family", FAMILIES)
def test_chunk_store_methods_run_on_family(family):
    from ragattn.methods import block_attention, fusionrag, turborag
    from ragattn.store import ChunkStore
    from ragattn.methods.baseline import full_prefill

    model, tok = _store_model(family), _tokenizer()
    store = ChunkStore(model)
    chunks = ["w1 w2 w3 w4 w5 w6", "w7 w8 w9 w10", "w11 w12 w13 w14 w15 w16 w17"]
    question = "w20 w21 w22"
    base = full_prefill(model, tok, chunks, question, max_new_tokens=3)
    answers = [
        turborag.answer(model, tok, chunks, question, positions="reordered", max_new_tokens=3, store=store),
        turborag.answer(model, tok, chunks, question, positions="composite", max_new_tokens=3, store=store),
        block_attention.answer(model, tok, chunks, question, max_new_tokens=3, store=store),
        fusionrag.answer(model, tok, chunks, question, max_new_tokens=3, store=store, ratio=0.3),
        fusionrag.cacheblend(model, tok, chunks, question, max_new_tokens=3, store=store, ratio=0.3,
                             check_layers=(1,)),   # (the tiny models have 2-3 layers)
    ]
    for ans in [base] + answers:
        assert 1 <= len(ans.tokens) <= 3 and torch.isfinite(ans.first_logits).all()
    # 100% recompute is full attention: FusionRAG's first token == the baseline's
    full = fusionrag.answer(model, tok, chunks, question, max_new_tokens=1, store=store, ratio=1.0)
    torch.testing.assert_close(full.first_logits.float(), base.first_logits.float(), rtol=1e-3, atol=1e-3)


def test_gemma3_with_two_ropes_refuses_the_chunk_store_by_name():
    from ragattn.store import ChunkStore

    with pytest.raises(NotImplementedError, match="different RoPE frequencies"):
        ChunkStore(_build("gemma3"))


# ----- families that remain refused ----------------------------------------------------------------
def _gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM, GPTNeoXConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                             num_attention_heads=2, vocab_size=VOCAB)


def test_unsupported_family_refused_when_loading_with_a_working_hint(tmp_path):
    cls, cfg = _gpt_neox()
    with pytest.raises(ValueError, match=r"'gpt_neox'.*attn_implementation='sdpa'"):
        cls._from_config(cfg, attn_implementation="ragattn")
    model = cls._from_config(cfg, attn_implementation="sdpa")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not supported"):
        cls.from_pretrained(tmp_path, attn_implementation="ragattn")
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        model.set_attn_implementation("ragattn")
    # the hint works
    cls.from_pretrained(tmp_path, attn_implementation="sdpa")


def test_hint_says_eager_where_transformers_refuses_sdpa():
    from ragattn.hf.registration import refuse_unsupported_family

    model = _build("gemma2")
    model.config.model_type = "gemma2-variant"   # a family without SDPA (Gemma 2's _supports_sdpa is False)
    try:
        with pytest.raises(ValueError, match="attn_implementation='eager'"):
            refuse_unsupported_family(model)
    finally:
        model.config.model_type = "gemma2"
    refuse_unsupported_family(model)   # supported: no error
