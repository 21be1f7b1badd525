"""verify_draft: the fast CPU default, the C++ twin (and the CUDA kernel) vs the float64 reference token for token,
the output distributions of each mode, greedy decoding, padding, edge cases and bad inputs."""
from __future__ import annotations

import pytest
import torch

import ragattn
from ragattn.reference import speculative as ref
from tests.helpers import randn_nonzero, use_kernel_backend

OP = torch.ops.ragattn.verify_draft


# ---------------------------------------------------------------------------------------------
# inputs


def make_case(bsz, g, vocab, *, dtype=torch.float32, temperature=1.0, gen=None, spread=2.0, closeness=1.0):
    """A batch of chains: target logits ``z``, draft probs ``q`` near ``p`` (so that a fair share
    of drafts is accepted), drafts sampled from ``q``, uniforms. CPU tensors."""
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    z = (spread * randn_nonzero(bsz, g + 1, vocab, generator=gen)).to(dtype)
    noise = torch.randn(bsz, g, vocab, generator=gen) * closeness
    q = torch.softmax((z[:, :g].float() + noise) / temperature, dim=-1)
    if g > 0 and bsz > 0:
        x = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(bsz, g)
    else:
        x = torch.zeros(bsz, g, dtype=torch.int64)
    u = torch.rand(bsz, g + 1, generator=gen)
    return x, q, z, u


def _decisions_are_robust(x, q, z, u, temperature, eta, alpha, num_draft, acc_rel=1e-5, draw_rel=2e-6):
    """Rows whose float64 decisions are far enough from every threshold that fp32 rounding in the
    kernel cannot flip them (acceptance tests and the inverse-CDF crossing). [B] bool."""
    bsz, g = x.shape
    out, n = ref.verify_draft(x, q, z, u, temperature, eta, alpha, False, num_draft)
    n = n.long()
    nd = torch.full((bsz,), g) if num_draft is None else num_draft.long()
    p = ref.target_probs(z, temperature)
    q64 = q.double()
    ok = torch.ones(bsz, dtype=torch.bool)
    rows = torch.arange(bsz)
    if g > 0:
        ph = ref.modified_target_probs(z[:, :g], q, temperature, eta, alpha)
        xs = torch.where(torch.arange(g)[None] < nd[:, None], x, torch.zeros_like(x))
        qx = q64.gather(-1, xs[..., None])[..., 0]
        phx = ph.gather(-1, xs[..., None])[..., 0]
        lhs = u[:, :g].double() * qx
        rel = (lhs - phx).abs() / torch.maximum(lhs, phx).clamp(min=1e-300)
        decided = torch.arange(g)[None] <= n[:, None]
        decided &= torch.arange(g)[None] < nd[:, None]
        ok &= ~(decided & (qx > 0) & (rel < acc_rel)).any(dim=1)
        nq = n.clamp(max=g - 1)
        w_res = ref.residual_weights(p[rows, n], q64[rows, nq], ph[rows, nq])
        mass = w_res.sum(-1)
        rejected = n < nd
        # a residual so small that fp32 may see it as zero (or not) is ambiguous
        ok &= ~(rejected & (mass > 0) & (mass < 1e-4))
        w = torch.where((rejected & (mass > 0))[:, None], w_res, p[rows, n])
    else:
        w = p[rows, n]
    cdf = torch.cumsum(w, -1)
    total = cdf[:, -1:]
    target = u[:, g:].double() * total
    gap = (cdf - target).abs().amin(-1) / total[:, 0]
    ok &= gap > draw_rel
    return ok


def robust_uniforms(x, q, z, u, temperature=1.0, eta=0.0, alpha=0.1, num_draft=None, gen=None):
    """Redraw the uniforms of rows whose outcome sits within rounding of a threshold."""
    u = u.clone()
    for _ in range(200):
        ok = _decisions_are_robust(x, q, z, u, temperature, eta, alpha, num_draft)
        if bool(ok.all()):
            return u
        bad = (~ok).nonzero()[:, 0]
        u[bad] = torch.rand(len(bad), u.shape[1], generator=gen)
    raise AssertionError("could not find uniforms away from every rounding threshold")


def robust_greedy_logits(x, q, z, temperature, eta, alpha, margin=1e-3):
    """Nudge target logits until the argmax of p_hat (and p) leads the runner-up by ``margin``."""
    z = z.clone()
    g = x.shape[1]
    for _ in range(100):
        zd = z.double()
        a = torch.log(ref.modified_target_probs(z[:, :g], q, temperature, eta, alpha).clamp(min=1e-300))
        lead = torch.cat([a, zd[:, g:] / temperature], dim=1) if g > 0 else zd / temperature
        top2 = lead.topk(2, dim=-1)
        close = (top2.values[..., 0] - top2.values[..., 1]) < margin
        if not bool(close.any()):
            return z
        b, j = close.nonzero(as_tuple=True)
        z[b, j, top2.indices[b, j, 0]] += torch.tensor(0.25).to(z.dtype)
    raise AssertionError("could not separate the greedy argmax")


def run(x, q, z, u, device, **kw):
    out, n = ragattn.verify_draft(x.to(device), None if q is None else q.to(device), z.to(device), u.to(device), **kw)
    return out.cpu(), n.cpu()


def assert_same(got, want, what=""):
    out, n = got
    out_r, n_r = want
    assert out.dtype == torch.int64 and n.dtype == torch.int32
    if not (torch.equal(n, n_r) and torch.equal(out, out_r)):
        bad = ((out != out_r).any(dim=1) | (n != n_r)).nonzero()[:, 0][:5].tolist()
        raise AssertionError(f"{what}: rows {bad} differ:\n got {out[bad].tolist()} n={n[bad].tolist()}\n"
                             f"want {out_r[bad].tolist()} n={n_r[bad].tolist()}")


def check_structure(out, n, x, num_draft=None):
    """Accepted prefix = the drafts, exactly one emitted token after it, then -1."""
    bsz, g = x.shape
    nd = torch.full((bsz,), g) if num_draft is None else num_draft.long()
    n = n.long()
    assert ((n >= 0) & (n <= nd)).all()
    pos = torch.arange(g + 1)[None]
    xs = torch.cat([x, torch.zeros(bsz, 1, dtype=x.dtype)], 1)
    assert torch.equal(out[pos < n[:, None]], xs[pos < n[:, None]])
    assert (out[pos > n[:, None]] == -1).all()
    assert (out.gather(1, n[:, None]) >= 0).all()


# ---------------------------------------------------------------------------------------------
# the twin (and on --device cuda the kernel) vs the float64 reference, token for token

CASES = [
    # bsz, g, vocab, dtype, temperature, eta, alpha, with num_draft
    (16, 4, 37, torch.float32, 1.0, 0.0, 0.1, False),
    (16, 4, 37, torch.float32, 1.0, 10.0, 0.1, False),
    (9, 1, 1000, torch.bfloat16, 0.7, 0.0, 0.1, False),
    (9, 1, 1000, torch.bfloat16, 0.7, 5.0, 0.3, False),
    (5, 16, 513, torch.float16, 1.0, 20.0, 0.1, True),
    (5, 16, 513, torch.float32, 0.1, 0.0, 0.1, True),
    (128, 3, 29, torch.float32, 1.0, 50.0, 0.1, True),
    (1, 10, 8193, torch.bfloat16, 1.0, 10.0, 0.1, False),
    (3, 2, 49157, torch.bfloat16, 1.0, 10.0, 0.1, True),
    (2, 3, 49157, torch.float32, 0.5, 0.0, 0.1, False),
]


@pytest.mark.parametrize("backend", ["default", "twin"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-g{c[1]}-V{c[2]}-{str(c[3])[6:]}-T{c[4]}-eta{c[5]}")
def test_matches_reference(device, seed, monkeypatch, case, backend):
    """The fast default CPU path and the bit-faithful twin (and on --device cuda the kernel) give the
    float64 reference's tokens wherever its decisions are not within float32 rounding of a threshold."""
    if backend == "twin" and device.type != "cpu":
        pytest.skip("CPU backend switch")
    use_kernel_backend(monkeypatch, device, backend)
    bsz, g, vocab, dtype, temperature, eta, alpha, padded = case
    gen = torch.Generator().manual_seed(seed)
    x, q, z, u = make_case(bsz, g, vocab, dtype=dtype, temperature=temperature, gen=gen)
    nd = torch.randint(0, g + 1, (bsz,), generator=gen, dtype=torch.int32) if padded else None
    if padded:
        x = torch.where(torch.arange(g)[None] < nd[:, None].long(), x, torch.full_like(x, -7))  # ignored
    u = robust_uniforms(x, q, z, u, temperature, eta, alpha, nd, gen)
    kw = dict(temperature=temperature, eta=eta, alpha=alpha, num_draft=None if nd is None else nd.to(device))
    got = run(x, q, z, u, device, **kw)
    want = ref.verify_draft(x, q, z, u, temperature, eta, alpha, False, nd)
    assert_same(got, want, "sampling")
    check_structure(*got, x, nd)
    # greedy on (nudged) logits with a clear argmax
    zg = robust_greedy_logits(x, q, z, temperature, eta, alpha)
    got = run(x, q, zg, u, device, greedy=True, **kw)
    want = ref.verify_draft(x, q, zg, u, temperature, eta, alpha, True, nd)
    assert_same(got, want, "greedy")


def test_reference_backend_matches_default(monkeypatch, seed):
    gen = torch.Generator().manual_seed(seed)
    x, q, z, u = make_case(8, 4, 101, gen=gen)
    u = robust_uniforms(x, q, z, u, 1.0, 5.0, 0.1, None, gen)
    fast = ragattn.verify_draft(x, q, z, u, eta=5.0)
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", "reference")
    assert_same(ragattn.verify_draft(x, q, z, u, eta=5.0), fast, "reference backend")


@pytest.mark.parametrize("group,cluster,reduce,totals", [
    ("1", "8", "4", "0"), ("3", "8", "4", "0"), ("8", "8", "4", "0"), ("1", "16", "4", "1"), ("1", "5", "4", "1"),
    ("1", "8", "1", "0"), ("1", "8", "2", "1")])
def test_cuda_matches_cpu_twin(device, seed, monkeypatch, group, cluster, reduce, totals):
    """The kernel and the twin (RAGATTN_CPU_BACKEND=twin) share every rounding: same tokens on any
    uniforms, no margin (vocabularies of 1 to 74 slices, padded and num_draft layouts; with eta > 0 the
    sm_90 one-pass kernel in clusters of RAGATTN_VERIFY_DRAFT_CLUSTER CTAs and, at V 300007, the two-pass
    path; at eta 0 with 16-bit logits phase 1 one slice per CTA or RAGATTN_VERIFY_DRAFT_GROUP slices,
    groups and clusters that split the slices unevenly too; the one-pass kernel's slices reduced
    RAGATTN_VERIFY_DRAFT_REDUCE at once, up to the CTA's slices: 4, 2 and 1, and a last round of 3; the
    draw's totals by that kernel, RAGATTN_VERIFY_DRAFT_PHASE1_TOTALS=1, or by the totals kernel)."""
    if device.type != "cuda":
        pytest.skip("needs --device cuda")
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", "twin")
    monkeypatch.setenv("RAGATTN_VERIFY_DRAFT_GROUP", group)
    monkeypatch.setenv("RAGATTN_VERIFY_DRAFT_CLUSTER", cluster)
    monkeypatch.setenv("RAGATTN_VERIFY_DRAFT_REDUCE", reduce)
    monkeypatch.setenv("RAGATTN_VERIFY_DRAFT_PHASE1_TOTALS", totals)
    gen = torch.Generator().manual_seed(seed)
    for bsz, g, vocab, dtype, eta in [(64, 10, 128256, torch.bfloat16, 0.0), (64, 10, 128256, torch.bfloat16, 10.0),
                                      (33, 16, 49157, torch.float16, 20.0), (128, 4, 32000, torch.float32, 5.0),
                                      (7, 3, 151, torch.bfloat16, 0.0), (200, 2, 1001, torch.bfloat16, 3.0),
                                      (1, 6, 50257, torch.float32, 10.0),
                                      # eta > 0 past the one-pass kernel's shared memory: the two-pass path
                                      (2, 2, 300007, torch.bfloat16, 10.0),
                                      # 18 slices, odd rows misaligned (the grouped kernel's scalar loads)
                                      (5, 4, 70001, torch.float16, 0.0)]:
        if group != "1" and (eta > 0 or dtype == torch.float32):
            continue  # (the grouped phase 1 runs at eta 0 with 16-bit logits only)
        if (cluster, reduce, totals) != ("8", "4", "0") and eta == 0:
            continue  # (clusters, their reductions and totals are the eta > 0 kernel's)
        x, q, z, u = make_case(bsz, g, vocab, dtype=dtype, gen=gen, closeness=0.3)
        nd = torch.randint(0, g + 1, (bsz,), generator=gen)
        for greedy in (False, True):
            for kw in (dict(), dict(num_draft=nd)):
                want = ragattn.verify_draft(x, q, z, u, temperature=0.8, eta=eta, greedy=greedy, **kw)
                kw = {k: v.to(device) for k, v in kw.items()}
                got = run(x, q, z, u, device, temperature=0.8, eta=eta, greedy=greedy, **kw)
                assert_same(got, want, f"cuda vs cpu B{bsz} V{vocab} eta{eta} greedy{greedy}")


# ---------------------------------------------------------------------------------------------
# op surface


@pytest.mark.parametrize("name,bad", [("RAGATTN_VERIFY_DRAFT_GROUP", "0"), ("RAGATTN_VERIFY_DRAFT_GROUP", "33"),
                                      ("RAGATTN_VERIFY_DRAFT_GROUP", "4x"), ("RAGATTN_VERIFY_DRAFT_CLUSTER", "17"),
                                      ("RAGATTN_VERIFY_DRAFT_CLUSTER", "-1"), ("RAGATTN_VERIFY_DRAFT_REDUCE", "3"),
                                      ("RAGATTN_VERIFY_DRAFT_REDUCE", "0"), ("RAGATTN_VERIFY_DRAFT_REDUCE", "8"),
                                      ("RAGATTN_VERIFY_DRAFT_PHASE1_TOTALS", "2")])
def test_bad_launch_choice_is_refused(device, monkeypatch, name, bad):
    """A launch knob outside its range is an error naming the variable, not a silent default."""
    if device.type != "cuda":
        pytest.skip("the CUDA launcher reads it")
    monkeypatch.setenv(name, bad)
    x, q, z, u = (t.to(device) for t in make_case(2, 3, 77))
    with pytest.raises(ValueError, match=name):
        ragattn.verify_draft(x, q, z, u, eta=1.0)


def test_opcheck(device):
    x, q, z, u = make_case(3, 4, 50)
    args = tuple(t.to(device) for t in (x, q, z, u))
    torch.library.opcheck(OP.default, args, {"temperature": 0.9, "eta": 3.0})
    nd = torch.tensor([0, 2, 4], dtype=torch.int32, device=device)
    torch.library.opcheck(OP.default, args, {"greedy": True, "num_draft": nd})


def test_empty_batch_and_zero_drafts(device):
    x, q, z, u = make_case(0, 3, 20)
    out, n = run(x, q, z, u, device)
    assert out.shape == (0, 4) and n.shape == (0,)
    x, q, z, u = make_case(4, 0, 20)  # g = 0: plain sampling from p
    out, n = run(x, q, z, u, device)
    assert out.shape == (4, 1) and (n == 0).all()
    assert_same((out, n), ref.verify_draft(x, q, z, u), "g=0")


def _bad_inputs():
    x, q, z, u = make_case(2, 3, 10)
    good = dict(draft_tokens=x, draft_probs=q, target_logits=z, uniforms=u)

    def with_(**kw):
        d = dict(good)
        extra = {k: kw.pop(k) for k in list(kw) if k not in d}
        d.update(kw)
        return d, extra

    oob = x.clone()
    oob[1, 2] = 10
    neg = x.clone()
    neg[0, 0] = -1
    u1 = u.clone()
    u1[1, 3] = 1.0
    unan = u.clone()
    unan[0, 1] = float("nan")
    return [
        (with_(draft_tokens=x.int()), TypeError, "draft_tokens must be int64"),
        (with_(draft_tokens=x[:, :2]), ValueError, "target_logits must have shape"),
        (with_(draft_probs=q.double()), TypeError, "draft_probs must be float32"),
        (with_(draft_probs=q[:, :, :9]), ValueError, "draft_probs must have shape"),
        (with_(target_logits=z.long()), TypeError, "target_logits must be"),
        (with_(target_logits=z[:, :3]), ValueError, "target_logits must have shape"),
        (with_(uniforms=u.double()), TypeError, "uniforms must be float32"),
        (with_(uniforms=u[:, :3]), ValueError, "uniforms must have shape"),
        (with_(draft_tokens=oob), ValueError, "draft_tokens must be in [0, V = 10), got 10 at [1, 2]"),
        (with_(draft_tokens=neg), ValueError, "draft_tokens must be in [0, V = 10), got -1"),
        (with_(uniforms=u1), ValueError, "uniforms must be in [0, 1), got 1"),
        (with_(uniforms=unan), ValueError, "uniforms must be in [0, 1)"),
        (with_(num_draft=torch.tensor([1, 4])), ValueError, "num_draft must be in [0, 3], got 4"),
        (with_(num_draft=torch.tensor([1, -1])), ValueError, "num_draft must be in [0, 3], got -1"),
        (with_(num_draft=torch.tensor([1.0, 2.0])), TypeError, "num_draft must be int32 or int64"),
        (with_(num_draft=torch.tensor([1, 2, 3])), ValueError, "num_draft must have shape"),
        (with_(temperature=0.0), ValueError, "temperature must be finite and > 0"),
        (with_(temperature=float("inf")), ValueError, "temperature must be finite and > 0"),
        (with_(eta=-1.0), ValueError, "eta must be finite and >= 0"),
        (with_(alpha=1.5), ValueError, "alpha must be in [0, 1]"),
    ]


@pytest.mark.parametrize("entry", _bad_inputs(), ids=lambda e: e[2][:40])
@pytest.mark.parametrize("layer", ["wrapper", "op"])
def test_bad_inputs(entry, layer):
    (tensors, extra), exc, msg = entry
    fn = ragattn.verify_draft if layer == "wrapper" else OP
    with pytest.raises(exc, match="ragattn.verify_draft") as info:
        fn(**tensors, **extra)
    assert msg in str(info.value)


def test_padded_drafts_are_ignored():
    """Out-of-range tokens and garbage probs/uniforms past num_draft do not matter (and no error)."""
    x, q, z, u = make_case(4, 5, 30, gen=torch.Generator().manual_seed(3))
    nd = torch.tensor([0, 2, 5, 1])
    u = robust_uniforms(x, q, z, u, num_draft=nd)
    want = ragattn.verify_draft(x, q, z, u, num_draft=nd)
    x2, q2, u2 = x.clone(), q.clone(), u.clone()
    pad = torch.arange(5)[None] >= nd[:, None]
    x2[pad] = 1000
    q2[pad] = float("nan")
    u2[:, :5][pad] = 0.999
    assert_same(ragattn.verify_draft(x2, q2, z, u2, num_draft=nd), want, "padding")
    assert want[1][0] == 0 and want[0][0, 1] == -1  # num_draft 0: one token drawn from p


def test_cpu_is_deterministic_across_threads(seed):
    gen = torch.Generator().manual_seed(seed)
    x, q, z, u = make_case(24, 4, 3001, gen=gen, dtype=torch.bfloat16)
    a = ragattn.verify_draft(x, q, z, u, eta=10.0)
    prev = torch.get_num_threads()
    torch.set_num_threads(max(2, prev))
    try:
        b = ragattn.verify_draft(x, q, z, u, eta=10.0)
    finally:
        torch.set_num_threads(prev)
    assert_same(b, a, "threads")


# ---------------------------------------------------------------------------------------------
# output distributions (fixed seeds, many independent rows sharing one distribution)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; categories expected below 5 are pooled."""
    n = counts.sum().double()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


def _shared_rows(n_rows, g, vocab, seed, temperature=1.0, closeness=1.0, forbid=None):
    """``n_rows`` chains over one distribution: z, q shared, drafts x ~ q and uniforms per row."""
    gen = torch.Generator().manual_seed(seed)
    z = 1.5 * randn_nonzero(1, g + 1, vocab, generator=gen)
    if forbid is not None:
        z[0, :, forbid] = float("-inf")  # probability 0 under the target (the draft still proposes it)
    zd = z[:, :g].clone()
    if forbid is not None:
        zd[0, :, forbid] = 3.0
    q = torch.softmax((zd + closeness * torch.randn(1, g, vocab, generator=gen)) / temperature, dim=-1)
    q = q.expand(n_rows, g, vocab).contiguous()
    zz = z.expand(n_rows, g + 1, vocab).contiguous()
    x = torch.multinomial(q.reshape(-1, vocab), 1, replacement=True, generator=gen).reshape(n_rows, g)
    u = torch.rand(n_rows, g + 1, generator=gen)
    return x, q, zz, u


N_SAMPLES = 20000


@pytest.mark.parametrize("backend", ["default", "twin"])
def test_eta0_first_token_follows_target(monkeypatch, backend):
    """Standard speculative sampling: the token emitted at a drafted position follows p exactly,
    including a target-forbidden token the draft likes (never emitted)."""
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", backend)  # the twin: the CUDA kernels' draw weights
    vocab, temperature = 12, 0.8
    x, q, z, u = _shared_rows(N_SAMPLES, 1, vocab, seed=11, temperature=temperature, forbid=3)
    out, n = ragattn.verify_draft(x, q, z, u, temperature=temperature)
    p = ref.target_probs(z[0, 0], temperature)
    counts = torch.bincount(out[:, 0], minlength=vocab)
    assert counts[3] == 0 and (x[:, 0] == 3).sum() > 500  # proposed often, never emitted
    assert 0.2 < float(n.float().mean()) < 0.9  # both branches (accept, residual) exercised
    assert _chi2_pvalue(counts, p) > 1e-3
    # the test has power: resampling the rejected token from p instead of the residual is caught
    q0 = q[0, 0].double()
    wrong = torch.minimum(q0, p) + (1 - torch.minimum(q0, p).sum()) * p
    assert _tv(wrong, p) > 0.02 and _chi2_pvalue(counts, wrong) < 1e-6


@pytest.mark.parametrize("backend", ["default", "twin"])
@pytest.mark.parametrize("alpha", [0.1, 0.6])
def test_rapid_first_token_follows_modified_distribution(monkeypatch, backend, alpha):
    """eta > 0: the emitted token follows min(q, p_hat) + (1 - beta) norm(max(p - min(q, p_hat), 0)),
    which is (deliberately) not p, and a draft is accepted with probability sum min(q, p_hat) (the
    acceptance is where p_hat shows most: too large a p_hat at unmasked tokens leaves the emitted
    distribution near p_out but raises it); alpha 0.1 masks 5 of the 12 tokens here, 0.6 one (the
    twin's p_hat of an unmasked token: p times the position's hat_scale)."""
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", backend)  # the twin: the CUDA kernels' draw weights
    vocab, temperature, eta = 12, 1.0, 10.0
    x, q, z, u = _shared_rows(N_SAMPLES, 1, vocab, seed=12, temperature=temperature, closeness=1.5)
    out, n = ragattn.verify_draft(x, q, z, u, temperature=temperature, eta=eta, alpha=alpha)
    p = ref.target_probs(z[0, 0], temperature)
    ph = ref.modified_target_probs(z[0, 0], q[0, 0], temperature, eta, alpha)
    p_out = ref.first_token_distribution(p, q[0, 0].double(), ph)
    counts = torch.bincount(out[:, 0], minlength=vocab)
    assert float(n.float().mean()) < 0.95  # the residual branch is exercised
    beta = float(torch.minimum(q[0, 0].double(), ph).sum())
    assert abs(float(n.double().mean()) - beta) < 5 * (beta * (1 - beta) / N_SAMPLES) ** 0.5, beta
    assert _tv(p_out, p) > 0.05  # the two hypotheses are far apart ...
    assert _chi2_pvalue(counts, p_out) > 1e-3  # ... the samples follow RAPID's distribution
    assert _chi2_pvalue(counts, p) < 1e-12  # ... and demonstrably not the target's


@pytest.mark.parametrize("backend", ["default", "twin"])
def test_bonus_token_follows_target(monkeypatch, backend):
    """When every draft is accepted the extra token is drawn from p at position num_draft (also for eta > 0)."""
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", backend)  # the twin: the CUDA kernels' draw weights
    vocab, g = 12, 2
    x, q, z, u = _shared_rows(N_SAMPLES, g, vocab, seed=13, closeness=0.3)
    out, n = ragattn.verify_draft(x, q, z, u, eta=5.0)
    full = n == g
    assert int(full.sum()) > 5000
    counts = torch.bincount(out[full, g], minlength=vocab)
    p_bonus = ref.target_probs(z[0, g], 1.0)
    assert _chi2_pvalue(counts, p_bonus) > 1e-3
    ph_last = ref.modified_target_probs(z[0, g - 1], q[0, g - 1], 1.0, 5.0, 0.1)
    assert _tv(ph_last, p_bonus) > 0.05 and _chi2_pvalue(counts, ph_last) < 1e-12


def test_all_zero_residual_falls_back_to_target():
    """q >= p everywhere (an unnormalised draft row) leaves a zero residual: the token is drawn from p
    (where RAPID's code divides 0 by 0)."""
    vocab, n_rows = 12, 8000
    gen = torch.Generator().manual_seed(14)
    z = randn_nonzero(1, 2, vocab, generator=gen).expand(n_rows, 2, vocab).contiguous()
    p32 = torch.softmax(z[:, :1].float(), dim=-1)
    q = (1.01 * p32).contiguous()
    x = torch.multinomial(p32[:, 0], 1, generator=gen)
    u = torch.rand(n_rows, 2, generator=gen)
    u[:, 0] = 0.999  # u q(x) > p(x): always rejected
    out, n = ragattn.verify_draft(x, q, z, u)
    assert (n == 0).all()
    p = ref.target_probs(z[0, 0], 1.0)
    assert ref.residual_weights(p, q[0, 0].double(), p).sum() == 0
    assert _chi2_pvalue(torch.bincount(out[:, 0], minlength=vocab), p) > 1e-3
    assert_same((out, n), ref.verify_draft(x, q, z, u), "fallback vs reference")


# ---------------------------------------------------------------------------------------------
# greedy decoding with a synthetic target and drafter


def _synthetic_logits(prefix, vocab, salt):
    h = salt
    for t in prefix[-4:]:
        h = (h * 1000003 + int(t) + 7) % (2**31 - 1)
    gen = torch.Generator().manual_seed(h)
    return 3.0 * torch.randn(vocab, generator=gen)


def _target(prefix, vocab):
    return _synthetic_logits(prefix, vocab, 17)


def _draft_probs(prefix, vocab, temperature):
    # the drafter agrees with the target most of the time
    return torch.softmax((_target(prefix, vocab) + 1.5 * _synthetic_logits(prefix, vocab, 23)) / temperature, -1)


def _speculative_greedy(gamma, eta, length, vocab=50, temperature=1.0, alpha=0.1):
    seq, bonus = [1], []
    while len(seq) < length:
        drafts, qs = [], []
        for _ in range(gamma):  # the drafter drafts greedily
            qj = _draft_probs(seq + drafts, vocab, temperature)
            qs.append(qj)
            drafts.append(int(qj.argmax()))
        z = torch.stack([_target(seq + drafts[:j], vocab) for j in range(gamma + 1)])[None]
        x = torch.tensor([drafts])
        out, n = ragattn.verify_draft(x, torch.stack(qs)[None], z, torch.rand(1, gamma + 1), temperature=temperature,
                                      eta=eta, alpha=alpha, greedy=True)
        k = int(n[0])
        emitted = out[0, : k + 1].tolist()
        bonus += [False] * k + [k == gamma]
        seq += emitted
    return seq[:length], bonus[: length - 1]


@pytest.mark.parametrize("eta", [0.0, 10.0])
def test_greedy_is_greedy_decoding_of_p_hat(eta):
    length, vocab, temperature, alpha = 40, 50, 1.0, 0.1
    seqs = {}
    for gamma in (1, 4, 16):
        seq, bonus = _speculative_greedy(gamma, eta, length, vocab, temperature, alpha)
        seqs[gamma] = seq
        for i in range(1, length):
            prefix = seq[:i]
            z = _target(prefix, vocab)
            if bonus[i - 1]:
                want = int(z.argmax())
            else:
                want = int(ref.modified_target_probs(z, _draft_probs(prefix, vocab, temperature), temperature, eta,
                                                     alpha).argmax())
            assert seq[i] == want, f"gamma {gamma}: token {i} is {seq[i]}, greedy decoding gives {want}"
        if eta > 0:  # p_hat really differs from p along the way (else this would not test much)
            assert any(not bonus[i - 1] and seq[i] != int(_target(seq[:i], vocab).argmax()) for i in range(1, length))
    if eta == 0:
        assert seqs[1] == seqs[4] == seqs[16]  # p_hat = p: the bonus changes nothing


# ---------------------------------------------------------------------------------------------
# edge cases


@pytest.mark.parametrize("temperature", [1e-3, 1e-20, 1e-45, 1e-60])
@pytest.mark.parametrize("eta", [0.0, 10.0])
def test_tiny_temperature(device, temperature, eta):
    """T -> 0: p (and p_hat) become one-hot on the argmax (uniform over exact ties): sampling is
    greedy decoding, whatever the uniforms."""
    gen = torch.Generator().manual_seed(5)
    x, q, z, u = make_case(96, 4, 300, gen=gen)
    t = 32  # rows 0..31 have an exact tie at the top
    z[:t, :, 7] = z[:t].amax(-1) + 1.0
    z[:t, :, 11] = z[:t, :, 7]
    got = run(x, q, z, u, device, temperature=temperature, eta=eta)
    want = ref.verify_draft(x, q, z, u, temperature, eta)
    out, n = got
    tied = out[:t].gather(1, n[:t, None].long())[:, 0]
    assert set(tied.tolist()) == {7, 11}  # the uniforms split the ties
    assert_same((out[t:], n[t:]), (want[0][t:], want[1][t:]), "tiny T")
    greedy = run(x, q, z, u, device, temperature=temperature, eta=eta, greedy=True)
    assert_same((out[t:], n[t:]), (greedy[0][t:], greedy[1][t:]), "tiny T sampling == greedy")


def test_draft_forbidden_by_target(device, seed):
    """A draft token with target probability 0 is never accepted, whatever its uniform."""
    gen = torch.Generator().manual_seed(seed)
    x, q, z, u = make_case(32, 3, 64, gen=gen, closeness=0.1)
    rows = torch.arange(0, 32, 2)
    z[rows, 0, x[rows, 0]] = float("-inf")
    u[rows, 0] = 0.0
    out, n = run(x, q, z, u, device, eta=10.0)
    assert (n[rows] == 0).all()
    assert (out[rows, 0] != x[rows, 0]).all()
    u = robust_uniforms(x, q, z, u, 1.0, 10.0)
    assert_same(run(x, q, z, u, device, eta=10.0), ref.verify_draft(x, q, z, u, 1.0, 10.0), "forbidden drafts")
