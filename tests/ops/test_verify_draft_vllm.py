"""Verify_draft on vLLM's rejection-sampler layout (flat [T, V] target logits, bonus
logits apart, [B] cumulative ends, per-request generators) through
ragattn.ops.verify_draft_vllm, against the padded native layout on random ragged batches."""
from __future__ import annotations

import pytest
import torch

from ragattn.ops.verify_draft import verify_draft, verify_draft_vllm
from tests.helpers import use_kernel_backend


def _batch(counts, vocab, seed, with_probs=True):
    g = torch.Generator().manual_seed(seed)
    B, T = len(counts), sum(counts)
    drafts = torch.randint(0, vocab, (T,), generator=g)
    logits = torch.randn(T, vocab, generator=g) * 2
    # drafts often agree with the target: accept runs of varied length
    agree = torch.rand(T, generator=g) < 0.6
    drafts = torch.where(agree, logits.argmax(-1), drafts)
    probs = torch.softmax(torch.randn(T, vocab, generator=g), -1) if with_probs else None
    bonus = torch.randn(B, vocab, generator=g) * 2
    ends = torch.tensor(counts).cumsum(0)
    return drafts, ends, logits, probs, bonus


def _padded(counts, drafts, logits, probs, bonus, seeds, vocab, width):
    """The same batch in verify_draft's padded layout ([B, g], [B, g + 1, V], num_draft), the
    uniforms drawn as vLLM draws them: each request's g_b acceptance draws then its final draw."""
    B = len(counts)
    d = torch.zeros(B, width, dtype=torch.int64)
    z = torch.full((B, width + 1, vocab), 0.5)
    q = torch.full((B, width, vocab), 1.0 / vocab) if probs is not None else None
    u = torch.full((B, width + 1), 0.25)
    start = 0
    for b, c in enumerate(counts):
        d[b, :c] = drafts[start:start + c]
        z[b, :c] = logits[start:start + c]
        z[b, c] = bonus[b]
        if q is not None:
            q[b, :c] = probs[start:start + c]
        r = torch.rand(c + 1, generator=torch.Generator().manual_seed(seeds[b]))
        u[b, :c] = r[:c]
        u[b, width] = r[c]  # the padded layout's final draw is column g
        start += c
    return d, q, z, u


@pytest.mark.parametrize("backend", ["default", "reference"])
@pytest.mark.parametrize("case", range(6))
def test_vllm_layout_matches_padded_native(monkeypatch, backend, case):
    use_kernel_backend(monkeypatch, torch.device("cpu"), backend)
    g = torch.Generator().manual_seed(100 + case)
    B = int(torch.randint(1, 7, (1,), generator=g))
    counts = torch.randint(0, 5, (B,), generator=g).tolist()
    counts[0] = 0 if case == 0 else counts[0]  # a request with no drafts
    vocab, temp = 37, [1.0, 0.7, 1.3][case % 3]
    drafts, ends, logits, probs, bonus = _batch(counts, vocab, case, with_probs=case % 2 == 0)
    seeds = [1000 * case + b for b in range(B)]
    gens = {b: torch.Generator().manual_seed(s) for b, s in enumerate(seeds)}
    width = max(counts) + (case == 4)  # vLLM's max_spec_len may exceed the batch's longest chain
    got = verify_draft_vllm(drafts, ends.to(torch.int32), logits, probs, bonus_logits=bonus, temperature=temp,
                            generators=gens, max_spec_len=width)
    d, q, z, u = _padded(counts, drafts, logits, probs, bonus, seeds, vocab, width)
    want, n_acc = verify_draft(d, q, z, u, temp, num_draft=torch.tensor(counts))
    assert got.shape == (B, width + 1) and got.dtype == torch.int64
    assert torch.equal(got, want), (got, want)
    assert torch.equal((got != -1).sum(1) - 1, n_acc.long())


def test_vllm_layout_per_request_temperature_and_greedy():
    """A [B] temperature: sampled requests as if verified alone at their temperature, greedy ones
    (temperature 0, vLLM's greedy marker) as greedy verification; bonus_token_ids emitted as given."""
    counts, vocab = [3, 0, 4, 2], 29
    drafts, ends, logits, probs, bonus = _batch(counts, vocab, 7)
    temps = torch.tensor([0.8, 0.0, 1.4, 0.0])
    gens = {b: torch.Generator().manual_seed(50 + b) for b in range(4)}
    bonus_ids = torch.tensor([5, 6, 7, 8])
    got = verify_draft_vllm(drafts, ends, logits, probs, bonus_token_ids=bonus_ids[:, None], temperature=temps,
                            generators=gens)
    start = 0
    for b, c in enumerate(counts):
        one = verify_draft_vllm(drafts[start:start + c], torch.tensor([c]), logits[start:start + c],
                                probs[start:start + c], bonus_token_ids=bonus_ids[b:b + 1],
                                temperature=float(temps[b]), generators={0: torch.Generator().manual_seed(50 + b)},
                                max_spec_len=4)
        assert torch.equal(got[b], one[0]), (b, got[b], one[0])
        n = int((got[b] != -1).sum()) - 1
        if n == c:  # every draft accepted: the given bonus token is emitted
            assert int(got[b, c]) == int(bonus_ids[b])
        if temps[b] == 0:  # greedy: accepted drafts are the target's argmax
            assert torch.equal(got[b, :n], logits[start:start + n].argmax(-1))
        start += c


def test_vllm_layout_errors():
    drafts, ends, logits, probs, bonus = _batch([2, 1], 11, 3)
    with pytest.raises(ValueError, match="verify_draft_vllm: give exactly one of bonus_logits"):
        verify_draft_vllm(drafts, ends, logits, probs)
    with pytest.raises(ValueError, match="verify_draft_vllm: cu_num_draft_tokens must be non-decreasing"):
        verify_draft_vllm(drafts, torch.tensor([2, 1]), logits, probs, bonus_logits=bonus)
    with pytest.raises(ValueError, match=r"verify_draft_vllm: target_logits must have shape \(T, V\) = \(3, V\)"):
        verify_draft_vllm(drafts, ends, logits[:2], probs, bonus_logits=bonus)
    with pytest.raises(ValueError, match="max_spec_len = 1 is below"):
        verify_draft_vllm(drafts, ends, logits, probs, bonus_logits=bonus, max_spec_len=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_vllm_layout_temperature_tensor_follows_the_float_rule(dtype):
    """A per-request temperature divides in float32 like the float form: with fp16 logits and
    T = 1e-4, z / T overflowed fp16 to inf and a draft of probability ~e^-100 was accepted about
    half the time; now the tensor form gives exactly the float form's tokens."""
    vocab, n = 37, 64
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(n, vocab, generator=g) * 8).to(dtype)   # |z| / 1e-4 far past fp16's 65504
    best = logits.float().argmax(-1)
    drafts = (best + 1) % vocab   # never the argmax: ~e^-(gap / T) at T = 1e-4
    ends = torch.arange(1, n + 1)
    bonus = torch.zeros(n, dtype=torch.int64) + 3
    for t in (1e-4, 0.3, 2.0):
        seeds = {b: torch.Generator().manual_seed(b) for b in range(n)}
        got = verify_draft_vllm(drafts, ends, logits, bonus_token_ids=bonus, temperature=torch.full((n,), t),
                                generators=seeds)
        seeds = {b: torch.Generator().manual_seed(b) for b in range(n)}
        want = verify_draft_vllm(drafts, ends, logits, bonus_token_ids=bonus, temperature=t, generators=seeds)
        assert torch.equal(got, want), (t, got[:, 0], want[:, 0])
        if t == 1e-4:
            gap = (logits.float().max(-1).values - logits.float().gather(1, drafts[:, None])[:, 0]) / t
            sure = gap > 50   # acceptance probability below e^-50
            assert not (got[sure, 0] == drafts[sure]).any()


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5], ids=str)
@pytest.mark.parametrize("form", ["float", "tensor"])
def test_vllm_layout_refuses_a_bad_temperature_in_either_form(temperature, form):
    drafts, ends, logits, probs, bonus = _batch([2, 1], 11, 3)
    t = temperature if form == "float" else torch.tensor([1.0, temperature])
    with pytest.raises(ValueError, match="verify_draft_vllm: temperature must be finite and >= 0"):
        verify_draft_vllm(drafts, ends, logits, probs, bonus_logits=bonus, temperature=t)


@pytest.mark.parametrize("bad", [-1, 11, 2**40])
def test_vllm_layout_refuses_a_bonus_token_out_of_the_vocabulary(bad):
    drafts, ends, logits, probs, _ = _batch([2, 1], 11, 3)
    with pytest.raises(ValueError, match=r"verify_draft_vllm: bonus_token_ids must be token ids in \[0, V = 11\)"):
        verify_draft_vllm(drafts, ends, logits, probs, bonus_token_ids=torch.tensor([4, bad]))
