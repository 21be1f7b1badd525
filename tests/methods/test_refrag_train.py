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


# ---------------------------------------------------------------- recipe pieces (no model)

from ragattn.apps import refrag_train as rt_app  # noqa: E402
from ragattn.methods.refrag import train as rt  # noqa: E402


def test_curriculum_grows_and_ends_at_max():
    rng = __import__("random").Random(0)
    total, M, S = 40, 5, 4
    ms = [rt.curriculum_num_chunks(i, total, M, S, rng) for i in range(total)]
    assert ms[0] == 1 and all(1 <= m <= M for m in ms)
    caps = [1 + round(j * (M - 1) / (S - 1)) for j in range(S)]
    for i, m in enumerate(ms):
        assert m <= caps[min(S - 1, i * S // total)]
    assert M in ms[-total // S:]                    # the last stage reaches the full length
    assert all(rt.curriculum_num_chunks(i, total, M, 1, rng) == M for i in range(total))
    with pytest.raises(ValueError, match="bad arguments"):
        rt.curriculum_num_chunks(total, total, M, S, rng)


def test_windows_masks_schedule_and_config_errors():
    rng = __import__("random").Random(1)
    docs = [torch.arange(100, 100 + n) for n in (7, 30, 45)]
    for w in rt.sample_windows(docs, 20, 24, 5, rng):
        assert w.context.numel() == 24 and w.target.numel() == 5
        assert torch.equal(w.target[:1], w.context[-1:] + 1)   # the target continues the context
    with pytest.raises(ValueError, match="no passage has 51 tokens"):
        rt.sample_windows(docs, 1, 48, 3, rng)
    m = rt.random_expand_masks(6, 7, 3, rng)
    assert m.dtype == torch.bool and (m.sum(1) == 3).all()
    lr = [rt.warmup_cosine(i, 50) for i in range(50)]
    assert lr[0] == 0.5 and lr[1] == 1.0 and all(a >= b for a, b in zip(lr[1:], lr[2:])) and lr[-1] < 0.01
    with pytest.raises(ValueError, match="rl_expand"):
        rt.TrainConfig(rl_chunks=4, rl_expand=4).validate()
    with pytest.raises(ValueError, match="stages"):
        rt.TrainConfig(stages=("recon", "sft")).validate()
    with pytest.raises(ValueError, match="rl_group"):
        rt.TrainConfig(rl_group=1).validate()
    assert rt_app.main(["--rl-expand", "0", "--no-progress"]) == 2      # one error line, exit status 2


def test_grpo_step_learns_a_synthetic_reward():
    """The GRPO loop alone (no decoder): reward = +1 when chunk 3 is among the picks. The greedy
    choice must move onto chunk 3 within 15 iterations (it is not there at the start)."""
    torch.manual_seed(0)
    B, L, G, T = 4, 6, 6, 1
    net = rt.PolicyNetwork(d_enc=16, d_model=32)
    c = torch.randn(B, L, 16)
    assert not (net(c).argmax(-1) == 3).all()
    opt, sched, params = rt.make_optimizer(net.parameters(), 1e-2, 15 * 2)
    g = torch.Generator().manual_seed(0)
    for _ in range(15):
        loss, r = rt.grpo_step(net, opt, sched, params, c, lambda o: (o == 3).any(-1).float(), T, G, 2, 0.2, g)
        assert r.shape == (B, G) and torch.isfinite(loss)
    assert (net(c).argmax(-1) == 3).all()


# ---------------------------------------------------------------- the recipe on SmolLM2 + MiniLM

def _documents(tokenizer):
    """Token streams for the stage tests (test data only: the recipe trains on FOLDOC,
    refrag_train.foldoc_documents): the shipped passages, one document per topic (ids sharing a
    prefix), ``"{title}\n{text}\n\n"`` each."""
    from ragattn.apps.corpus import DEFAULT_CORPUS, EVAL_CORPUS, load_corpus

    groups = {}
    for root in (EVAL_CORPUS, DEFAULT_CORPUS):
        for p in load_corpus(root).passages:
            groups.setdefault((root.name, p.id.rsplit("-", 1)[0]), []).append(f"{p.title}\n{p.text}\n\n")
    return [torch.tensor(tokenizer("".join(dict.fromkeys(t)), add_special_tokens=False)["input_ids"])
            for t in groups.values()]


@pytest.fixture(scope="module")
def refrag_k8(smollm2):
    """A RefragModel (k = 8) around the shared SmolLM2; the decoder's requires_grad is restored after."""
    from ragattn.methods.refrag.model import RefragModel

    model, tok = smollm2
    flags = [p.requires_grad for p in model.parameters()]
    torch.manual_seed(0)
    rm = RefragModel(model, tok, k=8)
    yield rm
    for p, f in zip(model.parameters(), flags):
        p.requires_grad_(f)
    model.eval()


def test_reconstruction_loss_falls_and_checkpoint_round_trips(refrag_k8, tmp_path):
    """8 seeded steps of the reconstruction stage (projector + the encoder's last layer, one chunk
    per example, batch 2) on two fixed 8-token chunks: their reconstruction NLL must drop by more
    than 0.7 nat (untrained ~6.3, after the 8 steps ~5.0; without an effective gradient it stays).
    Then the checkpoint round trip reproduces the trained losses bit for bit after scrambling."""
    rm = refrag_k8
    cfg = rt.TrainConfig(k=8, stages=("recon",), batch=2, max_chunks=1, curriculum_stages=1,
                         recon_steps=8, recon_lr=3e-4, encoder_layers=1, progress=False).validate()
    docs = _documents(rm.tokenizer)
    train_docs, held_docs = rt.split_documents(docs, cfg.heldout_frac, cfg.seed)
    assert len(held_docs) >= 3 and not {id(d) for d in train_docs} & {id(d) for d in held_docs}
    fixed = [train_docs[0][:8], train_docs[1][:8]]            # windows of exactly one chunk: fixed data
    eval_w = [rt.Window(d, d[:0]) for d in fixed]
    torch.manual_seed(0)
    res = rt.run_reconstruction(rm, cfg, fixed, eval_w)
    before, after = res.heldout_before["recon_nll"], res.heldout_after["recon_nll"]
    assert len(res.loss) == 8 and all(math.isfinite(x) for x in res.loss)
    assert after < before - 0.7, (before, after, res.loss)
    assert not any(p.requires_grad for p in rm.decoder.parameters())      # decoder stayed frozen

    rm.encoder.eval()
    with torch.no_grad():
        ref = rt.example_nll(rm, eval_w, reconstruct=True)
    path = rm.save_checkpoint(tmp_path / "k8.pt")
    with torch.no_grad():
        for p in rm.encoder.parameters():
            p.normal_()
    rm.load_checkpoint(path)
    with torch.no_grad():
        got = rt.example_nll(rm, eval_w, reconstruct=True)
    assert torch.equal(got, ref)


def test_policy_checkpoint_round_trip_and_rewards(refrag_k8, tmp_path):
    from ragattn.methods.refrag.expansion import load_policy, save_policy

    rm = refrag_k8
    torch.manual_seed(1)
    net = rt.PolicyNetwork(rm.encoder.d_enc, d_model=32)
    docs = _documents(rm.tokenizer)
    w = rt.sample_windows(docs, 2, 3 * 8, 6, __import__("random").Random(3))
    c = rt._chunk_vectors(rm, w)
    assert c.shape == (2, 3, rm.encoder.d_enc)
    p = save_policy(net, tmp_path / "pol.pt", extra={"k": 8})
    net2 = load_policy(p)
    assert net2.extra == {"k": 8}
    assert torch.equal(net2(c), net.eval()(c))
    # rewards = -NLL of each window under each selection, as single-row losses give them
    orders = torch.tensor([[[0], [2]], [[1], [0]]])
    r = rt.selection_rewards(rm, w, orders)
    for b in range(2):
        for g in range(2):
            m = torch.zeros(3, dtype=torch.bool)
            m[orders[b, g]] = True
            with torch.no_grad():
                single = rt.example_nll(rm, [w[b]], expand_masks=[m])
            torch.testing.assert_close(r[b, g], -single[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="not a ragattn-refrag-policy"):
        torch.save({"x": 1}, tmp_path / "bad.pt")
        load_policy(tmp_path / "bad.pt")


def test_cpt_and_rl_stages_run_and_report_consistent_baselines(refrag_k8):
    """One CPT step and one GRPO step at the smallest shapes; the reported references are checked
    against the plain decoder: every chunk expanded = SmolLM2 on the raw tokens."""
    rm = refrag_k8
    cfg = rt.TrainConfig(k=8, batch=2, max_chunks=2, curriculum_stages=1, target_tokens=4, eval_examples=2,
                         cpt_steps=1, rl_steps=1, rl_chunks=2, rl_expand=1, rl_group=2, ppo_epochs=1,
                         policy_width=16, encoder_layers=0, progress=False).validate()
    docs = _documents(rm.tokenizer)
    rng = __import__("random").Random(5)
    ev = rt.sample_windows(docs, 2, 16, 4, rng)
    res = rt.run_cpt(rm, cfg, docs, ev)
    assert len(res.loss) == 1 and math.isfinite(res.loss[0])
    rl, net = rt.run_rl(rm, cfg, docs, ev)
    assert len(rl.extra["reward"]) == 1 and math.isfinite(rl.extra["reward"][0])
    with torch.no_grad():
        ids = torch.stack([torch.cat([w.context, w.target]) for w in ev])
        lg = rm.decoder(input_ids=ids).logits[:, 15:-1].float()
        plain = torch.nn.functional.cross_entropy(lg.transpose(1, 2), ids[:, 16:], reduction="none").mean(1)
    for got in (res.heldout_after["nll_full_context"], rl.heldout_after["nll_all"]):
        assert abs(got - plain.mean().item()) < 1e-4
    expected = {"nll_none", "nll_random", "nll_ppl_desc", "nll_ppl_asc", "nll_learned", "nll_all"}
    assert set(rl.heldout_after) == expected
    assert all(math.isfinite(v) for v in rl.heldout_after.values())
