"""REFRAG training recipe and selective-expansion policies (ragattn.methods.refrag.expansion / .train).

Math tests run everywhere; the model tests (PerplexityPolicy, training loss, checkpoints) use the
``smollm2`` fixture and skip without the model packages.
"""
import itertools
import math

import pytest
import torch

from ragattn.methods.refrag.expansion import (
    LearnedPolicy, PerplexityPolicy, PolicyNetwork, chunk_perplexities, greedy_top_k,
    grpo_clip_loss, group_advantages, gumbel_top_k, selection_log_prob, selection_step_log_probs)


# ---------------------------------------------------------------- selection log-probs / sampling

def _sequential_logprob_ref(s, order, valid=None):
    """The paper's masked sequential softmax, written out step by step in float64."""
    s = [float(v) for v in s]
    allowed = [True] * len(s) if valid is None else [bool(v) for v in valid]
    out = []
    for i in order:
        z = math.log(sum(math.exp(s[j]) for j in range(len(s)) if allowed[j]))
        out.append(s[i] - z)
        allowed[i] = False
    return out


@pytest.mark.parametrize("L,T", [(1, 1), (5, 0), (7, 3), (13, 13)])
def test_selection_step_log_probs_match_sequential_softmax(L, T):
    g = torch.Generator().manual_seed(L * 31 + T)
    B = 3
    s = torch.randn(B, L, generator=g, dtype=torch.float64) * 2
    order = torch.stack([torch.randperm(L, generator=g)[:T] for _ in range(B)])
    got = selection_step_log_probs(s, order)
    assert got.shape == (B, T) and got.dtype == torch.float64
    for b in range(B):
        ref = _sequential_logprob_ref(s[b], order[b].tolist())
        torch.testing.assert_close(got[b], torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(selection_log_prob(s, order), got.sum(-1))


def test_selection_log_probs_with_padding_chunks():
    g = torch.Generator().manual_seed(5)
    s = torch.randn(2, 6, generator=g, dtype=torch.float64)
    valid = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 0, 1]], dtype=torch.bool)
    order = torch.tensor([[4, 0, 5], [3, 5, 0]])
    got = selection_step_log_probs(s, order, valid)
    for b in range(2):
        ref = _sequential_logprob_ref(s[b], order[b].tolist(), valid[b])
        torch.testing.assert_close(got[b], torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="padding chunk"):
        selection_step_log_probs(s, torch.tensor([[0, 1, 2], [1, 0, 2]]), valid)


def test_gumbel_top_k_samples_the_sequential_policy():
    """Empirical frequencies of ordered pairs vs the sequential formula (all 20 of them)."""
    s = torch.tensor([1.3, -0.4, 0.2, 0.9, -1.1], dtype=torch.float64)
    n_samples = 20000
    g = torch.Generator().manual_seed(0)
    orders = gumbel_top_k(s.expand(n_samples, 5), 2, generator=g)
    assert (orders[:, 0] != orders[:, 1]).all()
    counts = {}
    for a, b in orders.tolist():
        counts[(a, b)] = counts.get((a, b), 0) + 1
    for pair in itertools.permutations(range(5), 2):
        p = math.exp(sum(_sequential_logprob_ref(s, list(pair))))
        sd = math.sqrt(p * (1 - p) / n_samples)
        assert abs(counts.get(pair, 0) / n_samples - p) < 5 * sd + 1e-4, (pair, counts.get(pair, 0), p)


def test_gumbel_and_greedy_respect_validity_and_counts():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(4, 9, generator=g)
    valid = torch.rand(4, 9, generator=g) > 0.3
    valid[:, :3] = True
    for _ in range(20):
        o = gumbel_top_k(s, 3, valid, generator=g)
        assert o.shape == (4, 3)
        assert valid.gather(1, o).all()
        assert all(len(set(r)) == 3 for r in o.tolist())
    o = greedy_top_k(s, 3, valid)
    ref = torch.topk(s.masked_fill(~valid, -1e30), 3).indices
    assert torch.equal(o, ref)
    with pytest.raises(ValueError, match="fewer than"):
        gumbel_top_k(s, 3, torch.zeros_like(valid))
    with pytest.raises(ValueError, match="n_expand=10"):
        greedy_top_k(s, 10)
    with pytest.raises(ValueError, match="finite"):
        gumbel_top_k(torch.tensor([0.0, float("nan")]), 1)


# ---------------------------------------------------------------- GRPO math vs float64 reference

def _grpo_ref(logp_new, logp_old, rewards, eps_clip, eps_std=1e-6):
    B, G, T = len(logp_new), len(logp_new[0]), len(logp_new[0][0])
    total = 0.0
    advs = []
    for b in range(B):
        r = rewards[b]
        mean = sum(r) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (G - 1))
        a = [(x - mean) / (std + eps_std) for x in r]
        advs.append(a)
        for i in range(G):
            inner = 0.0
            for t in range(T):
                rho = math.exp(logp_new[b][i][t] - logp_old[b][i][t])
                clipped = min(max(rho, 1 - eps_clip), 1 + eps_clip)
                inner += min(rho * a[i], clipped * a[i])
            total += inner / T
    return -total / (B * G), advs


def test_grpo_advantages_and_clip_objective_match_reference():
    g = torch.Generator().manual_seed(7)
    B, G, T = 3, 5, 4
    rewards = torch.randn(B, G, generator=g, dtype=torch.float64) * 3 - 2
    logp_old = -torch.rand(B, G, T, generator=g, dtype=torch.float64) * 3
    # ratios spread well outside [0.8, 1.2] so the clip branch is exercised on both signs of A
    logp_new = (logp_old + torch.randn(B, G, T, generator=g, dtype=torch.float64) * 0.5).requires_grad_()
    adv = group_advantages(rewards)
    loss = grpo_clip_loss(logp_new, logp_old, adv, clip_eps=0.2)
    ref_loss, ref_adv = _grpo_ref(logp_new.tolist(), logp_old.tolist(), rewards.tolist(), 0.2)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert abs(loss.item() - ref_loss) < 1e-12
    torch.testing.assert_close(adv.mean(1), torch.zeros(B, dtype=torch.float64), atol=1e-12, rtol=0)
    # gradient: zero exactly where the clipped branch is the minimum (ratio outside the band, same side as A)
    loss.backward()
    rho = torch.exp(logp_new.detach() - logp_old)
    a = adv.unsqueeze(-1).expand_as(rho)
    clipped_active = ((a > 0) & (rho > 1.2)) | ((a < 0) & (rho < 0.8))
    assert clipped_active.any() and (~clipped_active).any()
    assert (logp_new.grad[clipped_active] == 0).all()
    torch.testing.assert_close(logp_new.grad[~clipped_active],
                               (-rho * a / (B * G * T))[~clipped_active], rtol=1e-12, atol=1e-15)


def test_grpo_equal_rewards_and_bad_inputs():
    adv = group_advantages(torch.full((2, 4), -3.25))
    assert torch.equal(adv, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.ones(3, 1))
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([[1.0, float("inf")]]))
    x = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"advantages must be \[B, G\]"):
        grpo_clip_loss(x, x, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="both be"):
        grpo_clip_loss(x, x[:, :, :2], torch.zeros(2, 3))
    with pytest.raises(ValueError, match="clip_eps"):
        grpo_clip_loss(x, x, torch.zeros(2, 3), clip_eps=1.5)


# ---------------------------------------------------------------- policies

def test_policy_network_and_learned_policy_select_exactly_n():
    torch.manual_seed(0)
    net = PolicyNetwork(d_enc=24, d_model=32, n_layers=2, n_heads=4)
    c = torch.randn(11, 24)
    toks = [torch.arange(8) for _ in range(11)]
    s = net(c)
    assert s.shape == (11,) and s.dtype == torch.float32
    for n in (0, 1, 4, 11):
        m = LearnedPolicy(net).select(c, toks, n)
        assert m.dtype == torch.bool and m.shape == (11,) and int(m.sum()) == n
        ms = LearnedPolicy(net, "sample", torch.Generator().manual_seed(n)).select(c, toks, n)
        assert int(ms.sum()) == n
    # greedy = the top-n logits
    assert torch.equal(LearnedPolicy(net).select(c, toks, 4).nonzero().flatten(),
                       torch.topk(s, 4).indices.sort().values)
    # batched forward with padding equals per-row forward on the valid prefix
    cb = torch.randn(2, 11, 24)
    valid = torch.ones(2, 11, dtype=torch.bool)
    valid[1, 7:] = False
    sb = net(cb, valid)
    torch.testing.assert_close(sb[1, :7], net(cb[1, :7]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="n_expand=12"):
        LearnedPolicy(net).select(c, toks, 12)
    with pytest.raises(ValueError, match="no chunks"):
        net(torch.randn(0, 24))
    with pytest.raises(ValueError, match=r"\[L, 24\]"):
        net(torch.randn(3, 25))
    with pytest.raises(ValueError, match="mode"):
        LearnedPolicy(net, "top")


def test_perplexity_policies(smollm2):
    model, tok = smollm2
    text = ("The Moon orbits the Earth once every 27 days. zq xv blorft kwip gnarl. "
            "Water boils at one hundred degrees Celsius at sea level.")
    ids = torch.tensor(tok(text)["input_ids"])
    chunks = list(ids.split(6))
    L = len(chunks)
    ppl = chunk_perplexities(model, chunks, tok.bos_token_id)
    assert ppl.shape == (L,) and torch.isfinite(ppl).all()
    # reference: one chunk's perplexity from a plain HF forward over the same prefix
    j = 2
    prefix = torch.cat([torch.tensor([tok.bos_token_id])] + chunks[:j + 1])
    with torch.no_grad():
        lg = model(input_ids=prefix[None]).logits[0].float()
    n = chunks[j].numel()
    ref = torch.nn.functional.cross_entropy(lg[-n - 1:-1], prefix[-n:])
    torch.testing.assert_close(ppl[j], ref, rtol=1e-4, atol=1e-4)
    c = torch.randn(L, 8)
    for n_expand in (0, 1, 3, L):
        desc = PerplexityPolicy(model, tok, "desc").select(c, chunks, n_expand)
        asc = PerplexityPolicy(model, tok, "asc").select(c, chunks, n_expand)
        assert int(desc.sum()) == n_expand and int(asc.sum()) == n_expand
    desc = PerplexityPolicy(model, tok, "desc").select(c, chunks, 2)
    asc = PerplexityPolicy(model, tok, "asc").select(c, chunks, 2)
    assert ppl[desc].min() >= ppl[~desc].max()
    assert ppl[asc].max() <= ppl[~asc].min()
    with pytest.raises(ValueError, match="n_expand=-1"):
        PerplexityPolicy(model, tok).select(c, chunks, -1)
    with pytest.raises(ValueError, match="empty context"):
        chunk_perplexities(model, [])
