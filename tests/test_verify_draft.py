"""verify_draft: the C++ twin (and the CUDA kernel) vs the float64 reference token for token,
the output distributions of each mode, greedy decoding, padding, edge cases and bad inputs."""
from __future__ import annotations

import pytest
import torch

import ragattn
from ragattn.reference import speculative as ref
from tests.helpers import randn_nonzero

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
    out, n = ragattn.verify_draft(x.to(device), q.to(device), z.to(device), u.to(device), **kw)
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


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-g{c[1]}-V{c[2]}-{str(c[3])[6:]}-T{c[4]}-eta{c[5]}")
def test_matches_reference(device, seed, case):
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


def test_reference_backend_matches_twin(monkeypatch, seed):
    gen = torch.Generator().manual_seed(seed)
    x, q, z, u = make_case(8, 4, 101, gen=gen)
    u = robust_uniforms(x, q, z, u, 1.0, 5.0, 0.1, None, gen)
    twin = ragattn.verify_draft(x, q, z, u, eta=5.0)
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", "reference")
    assert_same(ragattn.verify_draft(x, q, z, u, eta=5.0), twin, "reference backend")


def test_cuda_matches_cpu_twin(device, seed):
    """The kernel and the twin share every rounding: same tokens on any uniforms, no margin."""
    if device.type != "cuda":
        pytest.skip("needs --device cuda")
    gen = torch.Generator().manual_seed(seed)
    for bsz, g, vocab, dtype, eta in [(64, 10, 128256, torch.bfloat16, 0.0), (64, 10, 128256, torch.bfloat16, 10.0),
                                      (33, 16, 49157, torch.float16, 20.0), (128, 4, 32000, torch.float32, 5.0),
                                      (7, 3, 151, torch.bfloat16, 0.0)]:
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
