"""verify_draft's vocabulary slices: the CUDA kernels reduce each position in slices of
``kSliceLen`` tokens, one CTA each, fold the slices in order, and draw the final token by per-slice
totals and the prefix scans of the crossing slice alone (the first whose base + total passes u * total),
from its base. The C++ twin
(``RAGATTN_CPU_BACKEND=twin``) replays that structure with the same fold functions, so these tests
drive it (and on --device cuda the kernels) against the float64 reference at vocabularies of one
slice, several, a partial last one, less than one 8-token chunk; chains of 0 and 1 drafts; eta 0 and
> 0; all-accepted rows, first-position rejections, mass in one slice only, and non-finite logits."""
from __future__ import annotations

import pytest
import torch

from ragattn.bench.sm90 import VERIFY_DRAFT_SLICE_LEN as S
from ragattn.reference import speculative as ref
from tests.helpers import randn_nonzero, use_kernel_backend
from tests.ops.test_verify_draft import (assert_same, check_structure, make_case, robust_greedy_logits,
                                         robust_uniforms, run)

BACKENDS = ["twin", "default"]


def use_backend(monkeypatch, device, backend):
    """The twin or the fast default on CPU; on CUDA the kernels, once (under the "twin" id)."""
    if device.type != "cpu" and backend != "twin":
        pytest.skip("CUDA runs the kernels whatever the CPU backend")
    use_kernel_backend(monkeypatch, device, backend)

# vocabularies: less than a chunk, one partial slice, exactly one and two slices, a partial last slice
VOCABS = [5, 1001, S, 2 * S, 2 * S + 13, 3 * S + 1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("g", [0, 1, 3])
@pytest.mark.parametrize("eta", [0.0, 10.0])
def test_slices_match_reference(device, monkeypatch, backend, vocab, g, eta):
    """Sampling and greedy at every slicing, drafts mostly accepted (draft probs near p), spread mass."""
    use_backend(monkeypatch, device, backend)
    gen = torch.Generator().manual_seed(vocab * 7 + g)
    bsz = 6
    x, q, z, u = make_case(bsz, g, vocab, dtype=torch.bfloat16, gen=gen, spread=1.0, closeness=0.3)
    u = robust_uniforms(x, q, z, u, 1.0, eta, 0.1, None, gen)
    got = run(x, q, z, u, device, eta=eta)
    assert_same(got, ref.verify_draft(x, q, z, u, 1.0, eta, 0.1, False, None), f"V{vocab} g{g} eta{eta}")
    check_structure(*got, x)
    qo = torch.nn.functional.one_hot(x, vocab).float()
    zg = robust_greedy_logits(x, qo, z, 1.0, eta, 0.1)
    got = run(x, None, zg, u, device, eta=eta, greedy=True)  # one-hot drafts
    assert_same(got, ref.verify_draft(x, qo, zg, u, 1.0, eta, 0.1, True, None), "greedy")


def _peaked(bsz, g, vocab, hot, gen, dtype=torch.float32):
    """Logits whose mass sits on the tokens ``hot`` (a few per position, in chosen slices): the other
    tokens 12 nats lower, so that the draw's crossing falls in the hot tokens' slices."""
    z = randn_nonzero(bsz, g + 1, vocab, generator=gen) - 12.0
    hot = torch.as_tensor(hot)
    z[..., hot] = 2.0 * torch.rand(bsz, g + 1, len(hot), generator=gen) + 1.0
    return z.to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("eta", [0.0, 10.0])
@pytest.mark.parametrize("where", ["first", "middle", "last_partial", "across"])
def test_draw_lands_in_the_right_slice(device, monkeypatch, backend, eta, where):
    """The residual and bonus draws when the mass lives in one slice (or straddles a slice boundary):
    slice bases folded in order, slices without mass, the crossing slice searched alone."""
    use_backend(monkeypatch, device, backend)
    vocab = 3 * S + 77
    hot = {"first": [3, 9, 40, 41], "middle": [S + 5, S + 6, 2 * S - 1], "last_partial": [3 * S, 3 * S + 50, vocab - 1],
           "across": [S - 2, S - 1, S, S + 1, 2 * S + 3]}[where]
    gen = torch.Generator().manual_seed(len(where) * 31 + int(eta))
    bsz, g = 16, 2
    z = _peaked(bsz, g, vocab, hot, gen)
    # draft probs: mass on the hot tokens, but not p's (rejections), drafts sampled from q
    qz = _peaked(bsz, g, vocab, hot, gen)[:, :g]
    q = torch.softmax(qz, -1)
    x = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(bsz, g)
    u = robust_uniforms(x, q, z, torch.rand(bsz, g + 1, generator=gen), 1.0, eta, 0.1, None, gen)
    got = run(x, q, z, u, device, eta=eta)
    want = ref.verify_draft(x, q, z, u, 1.0, eta, 0.1, False, None)
    assert_same(got, want, where)
    emitted = got[0].gather(1, got[1][:, None].long())[:, 0]
    assert (emitted[:, None] == torch.tensor(hot)[None]).any(1).float().mean() > 0.9  # the draws hit the hot slice
    assert (got[1] < g).any()  # residual draws happened


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("eta", [0.0, 10.0])
def test_all_accepted_and_first_position_rejected(device, monkeypatch, backend, eta):
    """Rows that accept every draft (the bonus draw at position g from p) next to rows that reject
    their first draft (the residual draw at position 0), at a vocabulary of several slices."""
    use_backend(monkeypatch, device, backend)
    vocab, g, bsz = 2 * S + 13, 3, 12
    gen = torch.Generator().manual_seed(5)
    x, q, z, u = make_case(bsz, g, vocab, gen=gen, closeness=0.2)
    x = q.argmax(-1)  # a draft q likes and p likes too
    u[: bsz // 2, :g] = 0.0  # accept (q(x) > 0 and p_hat(x) > 0)
    # the other rows draft p's least likely token with q(x) = 1/2 first: rejected (even with RAPID's boost)
    rej = torch.arange(bsz // 2, bsz)
    x[rej, 0] = z[rej, 0].float().argmin(-1)
    q[rej, 0] = 0.5 * q[rej, 0] / q[rej, 0].sum(-1, keepdim=True)
    q[rej, 0, x[rej, 0]] += 0.5
    u[rej, 0] = 0.9
    u = robust_uniforms(x, q, z, u, 1.0, eta, 0.1, None, gen)
    got = run(x, q, z, u, device, eta=eta)
    want = ref.verify_draft(x, q, z, u, 1.0, eta, 0.1, False, None)
    assert_same(got, want, "accept all / reject first")
    assert (got[1][: bsz // 2] == g).all() and (got[1][bsz // 2:] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_residual_falls_back_to_p_over_slices(device, monkeypatch, backend):
    """q >= p everywhere leaves a residual that is zero in every slice: the draw folds p's slice totals
    instead (the fallback the draw kernels take from the same totals launch)."""
    use_backend(monkeypatch, device, backend)
    vocab, bsz = 2 * S + 13, 8
    gen = torch.Generator().manual_seed(9)
    z = randn_nonzero(bsz, 2, vocab, generator=gen)
    q = (1.01 * torch.softmax(z[:, :1].float(), -1)).contiguous()
    x = torch.multinomial(q[:, 0], 1, generator=gen)
    u = torch.rand(bsz, 2, generator=gen)
    u[:, 0] = 0.999
    u = robust_uniforms(x, q, z, u, 1.0, 0.0, 0.1, None, gen)
    got = run(x, q, z, u, device)
    assert (got[1] == 0).all()
    assert_same(got, ref.verify_draft(x, q, z, u), "zero residual")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("eta", [0.0, 10.0])
def test_non_finite_logits_over_slices(device, monkeypatch, backend, eta):
    """The documented rule across slices: +inf tokens in different slices share the mass, NaN and -inf
    have none (whole slices of them included), a position of all -inf/NaN rejects and emits token 0."""
    use_backend(monkeypatch, device, backend)
    vocab, g, bsz = 2 * S + 13, 2, 24
    gen = torch.Generator().manual_seed(11)
    x, q, z, u = make_case(bsz, g, vocab, gen=gen)
    inf, nan = float("inf"), float("nan")
    z[0:8, 0, 7] = inf
    z[0:8, 0, S + 3] = inf  # +inf in slices 0 and 1: 1/2 each
    z[8:16, 0, :S] = nan  # slice 0 without mass (NaN), slice 1 -inf: the mass sits in the partial slice 2
    z[8:16, 0, S:2 * S] = -inf
    z[16:24, 1] = -inf  # no mass at position 1
    z[16:24, 1, S + 1] = nan
    x[16:24, 0] = z[16:24, 0].argmax(-1)
    # uniforms away from rounding thresholds, judged on logits of the same float64 distributions (+-1e4
    # for +-inf and NaN); u = 0 accepts position 0 of the last rows whatever they are
    zr = torch.where(z.isnan() | (z == -inf), torch.full_like(z, -1e4), torch.where(z == inf, torch.full_like(z, 1e4), z))
    u = robust_uniforms(x, q, zr, u, 1.0, eta, 0.1, None, gen)
    u[16:24, 0] = 0.0
    out, n = run(x, q, z, u, device, eta=eta)
    emitted = out.gather(1, n[:, None].long())[:, 0]
    assert set(emitted[0:8][n[0:8] == 0].tolist()) <= {7, S + 3}
    assert (out[8:16, 0] >= 2 * S).all()  # neither NaN nor -inf tokens are emitted
    assert ((n[16:24] == 1) & (emitted[16:24] == 0)).all()
    assert_same((out, n), ref.verify_draft(x, q, z, u, 1.0, eta, 0.1, False, None), "non-finite")
