"""RAPID (ragattn.methods.rapid): greedy exactness against the target's own decoding, the output
distribution under sampling, O(1) cache rollback, retrieval and option validation."""
import math

import pytest
import torch

from ragattn.methods import rapid

transformers = pytest.importorskip("transformers")


# ----------------------------------------------------------------------------------------------
# tiny random models (vocab 5): cheap enough for a few thousand seeded generations


def tiny_llama(seed: int, vocab: int = 4, logit_scale: float = 3.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # peaky, clearly different distributions (a test with power)
        model.lm_head.weight.mul_(logit_scale / model.lm_head.weight.norm(dim=1, keepdim=True))
        model.model.norm.weight.fill_(1.0)
    return model


def perturbed(model, seed: int, noise: float):
    """A drafter: ``model`` with Gaussian noise on the lm_head (agrees with it part of the time)."""
    import copy

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = other.lm_head.weight
        w.add_(noise * w.norm(dim=1, keepdim=True) * torch.randn(w.shape, generator=g) / w.shape[1] ** 0.5)
    return other


@pytest.fixture(scope="module")
def tiny_pair():
    target = tiny_llama(1)
    return target, perturbed(target, 2, 2.5)


def exact_joint(model, prompt, horizon, vocab, temperature=1.0):
    """Probability of every continuation of ``horizon`` tokens (EOS-free): float64 ``[vocab] * horizon``."""
    import itertools

    seqs = list(itertools.product(range(vocab), repeat=horizon - 1))
    ids = torch.tensor([list(prompt) + list(s) for s in seqs])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1:].double()       # [S, horizon, V]
    lp = torch.log_softmax(logits / temperature, -1)
    joint = torch.zeros([vocab] * horizon, dtype=torch.float64)
    for s, row in zip(seqs, lp):
        base = sum(float(row[i, t]) for i, t in enumerate(s))
        joint[s] = torch.exp(base + row[horizon - 1])
    return joint


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs`` (cells with a small expectation
    pooled into one), via the Wilson-Hilferty normal approximation of the chi-square tail."""
    n = counts.sum()
    exp = probs.flatten() * n
    obs = counts.flatten().double()
    small = exp < min_expected
    e = torch.cat([exp[~small], exp[small].sum().view(1)])
    o = torch.cat([obs[~small], obs[small].sum().view(1)])
    keep = e > 0
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    if bool((~keep & (o > 0)).any()):
        return 0.0
    k = int(keep.sum()) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampling_eta0_follows_target(tiny_pair):
    """eta = 0, sampling, a drafter that disagrees often: the 3-token continuations follow the
    target's joint distribution (chi-square), and clearly not the drafter's (the test has power)."""
    target, drafter = tiny_pair
    prompt, vocab, horizon, n = [1, 3, 0, 2, 3, 1], 4, 3, 400
    dec = rapid.RapidDecoder(target, prompt, prompt[2:], drafter=drafter,
                             options=rapid.RapidOptions(gamma=2, eta=0.0, greedy=False),
                             max_new_tokens=horizon, generator=torch.Generator().manual_seed(0))
    dec.prefill()
    counts = torch.zeros([vocab] * horizon)
    drafted = accepted = 0
    for _ in range(n):
        dec.reset()  # O(1) rollback to the prompts
        toks = dec.run()
        counts[tuple(toks)] += 1
        drafted, accepted = drafted + dec.stats.drafted, accepted + dec.stats.accepted
    assert 0.2 < accepted / drafted < 0.8, accepted / drafted  # rejections and acceptances both
    p_target = exact_joint(target, prompt, horizon, vocab)
    p_drafter = exact_joint(drafter, prompt[2:], horizon, vocab)
    assert chi_square_pvalue(counts, p_target) > 1e-3
    assert chi_square_pvalue(counts, p_drafter) < 1e-6


def _fresh_kv(model, ids):
    cache = rapid.new_cache(model, len(ids) + 1)
    rapid.prefill(model, ids, cache)
    n = len(ids)
    rows = cache.slot_rows(0, torch.arange(n))
    return ([k.view(-1, *k.shape[2:])[rows] for k in cache.k],
            [v.view(-1, *v.shape[2:])[rows] for v in cache.v])


@pytest.mark.parametrize("greedy", [False, True])
def test_rollback_matches_fresh_prefill(tiny_pair, greedy):
    """After every round both caches hold exactly the K/V of a fresh prefill of the accepted text
    (target: every committed token but the last; drafter: what it has seen), in their first
    ``lengths`` slots; rejected drafts leave no trace."""
    target, drafter = tiny_pair
    prompt = [2, 3, 1, 0, 3, 3, 1, 2, 0, 1, 2]
    dec = rapid.RapidDecoder(target, prompt, prompt[4:], drafter=drafter,
                             options=rapid.RapidOptions(gamma=2, greedy=greedy),
                             max_new_tokens=40, generator=torch.Generator().manual_seed(3))
    dec.prefill()
    for c in (dec.t_cache, dec.d_cache):  # poison the unused slots: a stale read would show
        for t in c.k + c.v:
            t.view(-1, *t.shape[2:])[c.slot_rows(0, torch.arange(int(c.lengths[0]), c.capacity))] = float("nan")
    rejected = full = 0
    while not dec.done:
        before = dec.stats.accepted, dec.stats.drafted
        dec.step()
        n, g = dec.stats.accepted - before[0], dec.stats.drafted - before[1]
        rejected, full = rejected + (n < g), full + (n == g and g > 0)
        text = prompt + dec.tokens
        assert int(dec.t_cache.lengths[0]) == dec.t_len == len(text) - 1
        assert dec.last == text[-1]
        d_text = prompt[4:] + dec.tokens
        assert d_text[dec.d_len:] == dec.pending and 1 <= len(dec.pending) <= 2
        for model, cache, ids in ((target, dec.t_cache, text[:-1]), (drafter, dec.d_cache, d_text[:dec.d_len])):
            k_ref, v_ref = _fresh_kv(model, ids)
            rows = cache.slot_rows(0, torch.arange(len(ids)))
            for layer in range(len(cache.k)):
                k = cache.k[layer].view(-1, *cache.k[layer].shape[2:])[rows]
                v = cache.v[layer].view(-1, *cache.v[layer].shape[2:])[rows]
                torch.testing.assert_close(k, k_ref[layer], atol=2e-5, rtol=1e-4)
                torch.testing.assert_close(v, v_ref[layer], atol=2e-5, rtol=1e-4)
    assert len(dec.tokens) == 40 and rejected > 0 and (greedy or full > 0)


def test_budget_and_eos_end_cleanly(tiny_pair):
    target, drafter = tiny_pair
    prompt = [1, 2, 3]
    for m in (1, 2, 5, 9):
        dec = rapid.RapidDecoder(target, prompt, prompt, drafter=drafter,
                                 options=rapid.RapidOptions(gamma=4), max_new_tokens=m)
        dec.prefill()
        assert len(dec.run()) == m
    # greedy reference of the target alone, then make its 4th token the EOS: output stops there
    dec = rapid.RapidDecoder(target, prompt, prompt, drafter=drafter,
                             options=rapid.RapidOptions(gamma=3), max_new_tokens=12)
    dec.prefill()
    ref = dec.run()
    eos = ref[3]
    dec = rapid.RapidDecoder(target, prompt, prompt, drafter=drafter,
                             options=rapid.RapidOptions(gamma=3), max_new_tokens=12, eos_ids=[eos])
    dec.prefill()
    out = dec.run()
    assert out == ref[:ref.index(eos) + 1] and dec.done


def test_options_validation(tiny_pair):
    bad = [dict(gamma=0), dict(gamma=2.0), dict(eta=-1.0), dict(eta=float("nan")), dict(alpha=1.5),
           dict(temperature=0.0), dict(temperature=float("inf")), dict(greedy="yes"),
           dict(confidence_threshold=1.0), dict(eta="1")]
    for kw in bad:
        with pytest.raises((ValueError, TypeError), match=next(iter(kw))):
            rapid.RapidOptions(**kw)
    target, _ = tiny_pair
    with pytest.raises(ValueError, match="max_new_tokens"):
        rapid.RapidDecoder(target, [1], [1], max_new_tokens=0)
    with pytest.raises(ValueError, match="vocabulary"):
        rapid.RapidDecoder(target, [1], [1], drafter=tiny_llama(3, vocab=7))
    with pytest.raises(TypeError, match="options"):
        rapid.RapidDecoder(target, [1], [1], options=dict(gamma=2))
    with pytest.raises(ValueError, match="at least one token"):
        rapid.RapidDecoder(target, [], [1])


def test_split_text_covers_and_bounds(smollm2):
    _, tok = smollm2
    text = ("Alpha beta gamma. " * 30 + "\n\n" + "A long line without separators " * 10 + "\n"
            + "x" * 700)
    spans = rapid.split_text(tok, text, chunk_tokens=40)
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no overlap
    assert all(rapid._num_tokens(tok, text[a:b]) <= 40 for a, b, _ in spans)
    with pytest.raises(ValueError, match="chunk_tokens"):
        rapid.split_text(tok, text, 0)


# ----------------------------------------------------------------------------------------------
# SmolLM2: greedy RAPID == the target's own greedy decoding


@pytest.fixture(scope="module")
def short_qa():
    from ragattn.apps.corpus import load_corpus

    corpus = load_corpus()
    docs = [p.render() for p in corpus.passages[:4]]   # ~330 tokens: short enough for CI
    return docs, [q.question for q in corpus.questions[:3]] + ["Describe the moons of Mars."]


def test_greedy_eta0_equals_target_greedy(smollm2, short_qa):
    """Token for token equal to the target decoding alone, one token per step on the same cache
    path (at a near-tie, 0.014 logits on the 4th question, a different attention path such as
    SDPA's may pick the other token: HF generate() is checked on the first question only)."""
    model, tok = smollm2
    docs, questions = short_qa
    for i, question in enumerate(questions[::-1][:3]):
        target_ids, draft_ids = rapid.prompts(
            tok, docs, question, rapid.build_retrieval_context(tok, docs, question, budget_tokens=80))
        assert len(draft_ids) < len(target_ids) - 150   # the drafter really reads less
        dec = rapid.RapidDecoder(model, target_ids, draft_ids, options=rapid.RapidOptions(gamma=7),
                                 max_new_tokens=10)
        dec.prefill()
        ref, _, _ = rapid.decode_autoregressive(model, dec.t_cache, dec.t_len, dec.last, 10)
        if i == 2:
            hf = model.generate(torch.tensor([target_ids]), max_new_tokens=10, do_sample=False,
                                eos_token_id=None)[0, len(target_ids):].tolist()
            assert hf == ref
        for gamma in ((1, 4), (2, 7), (3,))[i]:
            dec.opt = rapid.RapidOptions(gamma=gamma)
            dec.reset()
            assert dec.run() == ref, (question, gamma)
        assert 0 < dec.stats.acceptance_rate <= 1


def test_generate_api_modes(smollm2, short_qa):
    model, tok = smollm2
    docs, questions = short_qa
    out = rapid.generate(model, tok, docs, questions[0], gamma=3, max_new_tokens=6, budget_tokens=80)
    lc = rapid.generate(model, tok, docs, questions[0], mode="lc", max_new_tokens=6, budget_tokens=80)
    assert out.tokens == lc.tokens and out.text.strip()
    assert out.retrieval.tokens <= 80 and out.draft_prompt_len < out.target_prompt_len
    st = out.stats
    assert st.generated == len(out.tokens) and st.rounds >= math.ceil(len(out.tokens) / 4)
    assert st.tokens_per_target_step >= 1 and st.decode_s > 0
    torch.testing.assert_close(out.first_logits, lc.first_logits, atol=1e-3, rtol=1e-3)
    ans = rapid.answer(model, tok, docs, questions[0], max_new_tokens=6, gamma=3, budget_tokens=80)
    assert ans.tokens == out.tokens and 0 < ans.ttft_s <= ans.total_s and ans.method == "rapid"
    # through model.generate(): transformers prepares the inputs, rapid.hf_generate decodes
    target_ids, draft_ids = rapid.prompts(tok, docs, questions[0], out.retrieval)
    seq = model.generate(torch.tensor([target_ids]), custom_generate=rapid.hf_generate,
                         rapid_draft_ids=draft_ids, rapid_gamma=3, max_new_tokens=6, do_sample=False)
    assert seq[0, len(target_ids):].tolist() == out.tokens
    with pytest.raises(ValueError, match="mode"):
        rapid.generate(model, tok, docs, questions[0], mode="magic")
    with pytest.raises(ValueError, match="context is empty"):
        rapid.generate(model, tok, ["  "], questions[0])
