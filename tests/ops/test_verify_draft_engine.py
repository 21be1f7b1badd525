"""verify_draft with non-finite logits, engine layouts, its fake impl and inference mode."""
from __future__ import annotations
import pytest
import torch
import ragattn
from ragattn.reference import speculative as ref
from tests.helpers import use_kernel_backend

from tests.ops.test_verify_draft import (OP, _bad_inputs, assert_same, check_structure, make_case,
                                         robust_greedy_logits, robust_uniforms, run)


# ---------------------------------------------------------------------------------------------
# non-finite logits, engine layouts, fake impl and inference mode


BACKENDS = ["default", "reference", "twin"]


def test_twin_backend_is_selectable(monkeypatch, seed):
    """RAGATTN_CPU_BACKEND=twin runs the bit-faithful twin of the CUDA kernel (another accumulation
    order than the fast default: on robust uniforms both give the reference's tokens) through the
    wrapper and through torch.ops alike."""
    gen = torch.Generator().manual_seed(seed)
    x, q, z, u = make_case(6, 3, 3001, gen=gen, dtype=torch.bfloat16)
    u = robust_uniforms(x, q, z, u, 1.0, 10.0, 0.1, None, gen)
    want = ref.verify_draft(x, q, z, u, 1.0, 10.0)
    assert_same(ragattn.verify_draft(x, q, z, u, eta=10.0), want, "default")
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", "twin")
    assert_same(ragattn.verify_draft(x, q, z, u, eta=10.0), want, "twin (wrapper)")
    assert_same(OP(x, q, z, u, eta=10.0), want, "twin (torch.ops)")



@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_non_finite_logits_one_rule(device, monkeypatch, backend, dtype):
    """NaN/-inf: probability 0; +inf tokens share the mass; all -inf/NaN: reject, emit 0. Same
    tokens on every backend (the reference used to emit token 0 for a +inf logit)."""
    use_kernel_backend(monkeypatch, device, backend)
    gen = torch.Generator().manual_seed(21)
    bsz, g, vocab = 64, 2, 40
    x, q, z, u = make_case(bsz, g, vocab, gen=gen, dtype=dtype)
    inf = float("inf")
    z[0:16, 0, 5] = inf  # one +inf token at the first drafted position: p = one-hot on 5
    z[16:32, 0, 7] = inf
    z[16:32, 0, 30] = inf  # two +inf tokens: each 1/2
    x[16:24, 0] = 7  # half of those rows draft a +inf token, the other half a finite one
    x[24:32, 0] = 1
    z[32:40, g, 11] = inf  # +inf at the bonus position
    x[32:40] = z[32:40, :g].float().argmax(-1)
    u[32:40, :g] = 0.0  # accepted (q > 0 and p_hat > 0): reach the bonus
    z[40:48, 0, :20] = float("nan")  # NaN: probability 0, never emitted
    z[48:56, 1] = float("-inf")  # no mass at position 1
    z[48:56, 1, 3] = float("nan")
    u[48:56, 0] = 0.0
    x[48:56, 0] = z[48:56, 0].float().argmax(-1)
    out, n = run(x, q, z, u, device)
    emitted = out.gather(1, n[:, None].long())[:, 0]
    hit = x[0:16, 0] == 5  # p is one-hot on 5: that draft is always accepted, any other rejected for 5
    assert ((hit & (n[0:16] >= 1)) | (~hit & (n[0:16] == 0) & (emitted[0:16] == 5))).all()
    assert set(emitted[24:32].tolist()) <= {7, 30} and (n[24:32] == 0).all()
    acc7 = u[16:24, 0] * q[16:24, 0, 7] < 0.5
    assert torch.equal(n[16:24] > 0, acc7)
    assert ((n[32:40] == g) & (emitted[32:40] == 11)).all()
    assert (out[40:48, 0] >= 20).all()  # a NaN-logit token is neither accepted nor emitted
    assert ((n[48:56] == 1) & (emitted[48:56] == 0)).all()
    assert not ((out >= vocab) | (out < -1)).any()
    want = ref.verify_draft(x, q, z, u)
    assert_same((out, n), want, f"non-finite logits ({backend})")
    greedy = run(x, q, z, u, device, greedy=True)
    assert_same(greedy, ref.verify_draft(x, q, z, u, greedy=True), "non-finite greedy")


def _flatten(x, q, z, u, nd):
    """Padded chains -> vLLM's flat layout (cu_num_draft, T drafts, T + B logits rows)."""
    bsz, g = x.shape
    nd = nd.long()
    cu = torch.zeros(bsz + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(nd, 0)
    drafted = torch.arange(g)[None] < nd[:, None]
    rows = torch.arange(g + 1)[None] <= nd[:, None]
    u2 = u.clone()
    u2[torch.arange(bsz), nd] = u[:, g]  # the final draw sits in the request's last row
    return cu, x[drafted], None if q is None else q[drafted], z[rows], u2[rows], rows


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("eta", [0.0, 10.0])
def test_flat_layout_and_one_hot_drafts(device, seed, monkeypatch, backend, with_probs, eta):
    """cu_num_draft (vLLM's flat layout) gives the padded layout's tokens; draft_probs=None gives
    what an explicit one-hot q gives; both match the float64 reference."""
    use_kernel_backend(monkeypatch, device, backend)
    gen = torch.Generator().manual_seed(seed)
    bsz, g, vocab = 11, 5, 301
    x, q, z, u = make_case(bsz, g, vocab, gen=gen, dtype=torch.bfloat16)
    nd = torch.randint(0, g + 1, (bsz,), generator=gen)
    nd[0] = 0
    if not with_probs:
        onehot = torch.nn.functional.one_hot(x, vocab).float()
        q_run, q_ref = None, onehot
    else:
        q_run = q_ref = q
    u = robust_uniforms(x, q_ref, z, u, 1.0, eta, 0.1, nd, gen)
    padded = run(x, q_ref, z, u, device, eta=eta, num_draft=nd.to(device))
    want = ref.verify_draft(x, q_ref, z, u, 1.0, eta, 0.1, False, nd)
    assert_same(padded, want, "padded vs reference")
    if not with_probs:
        none_q = ragattn.verify_draft(x.to(device), None, z.to(device), u.to(device), eta=eta, num_draft=nd.to(device))
        assert_same((none_q[0].cpu(), none_q[1].cpu()), padded, "draft_probs=None vs explicit one-hot")
    cu, xf, qf, zf, uf, rows = _flatten(x, q_run, z, u, nd)
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    out, n = ragattn.verify_draft(dev(xf), dev(qf), dev(zf), dev(uf), eta=eta, cu_num_draft=dev(cu))
    out, n = out.cpu(), n.cpu()
    assert out.shape == (int(cu[-1]) + bsz,) and torch.equal(n, padded[1])
    assert torch.equal(out, padded[0][rows])
    flat_ref = ref.verify_draft(xf, qf, zf, uf, 1.0, eta, 0.1, False, None, cu_num_draft=cu)
    assert torch.equal(flat_ref[0], out) and torch.equal(flat_ref[1], n)
    greedy = ragattn.verify_draft(dev(xf), dev(qf), dev(zf), dev(uf), eta=eta, greedy=True, cu_num_draft=dev(cu))
    greedy_padded = run(x, q_ref, robust_greedy_logits(x, q_ref, z, 1.0, eta, 0.1), u, device, eta=eta, greedy=True,
                        num_draft=nd.to(device))
    assert greedy[0].shape == out.shape and greedy_padded[0].shape == (bsz, g + 1)


def test_flat_layout_bad_inputs():
    x, q, z, u = make_case(3, 2, 10)
    cu = torch.tensor([0, 2, 2, 4])
    xf, qf, zf, uf = x.reshape(-1)[:4], q.reshape(-1, 10)[:4], z.reshape(-1, 10)[:7], u.reshape(-1)[:7]
    cases = [
        (dict(cu_num_draft=torch.tensor([0, 2, 1, 4])), ValueError, "cu_num_draft must be non-decreasing"),
        (dict(cu_num_draft=torch.tensor([0, 2, 3, 5])), ValueError, "cu_num_draft must start at 0 and end at T = 4"),
        (dict(cu_num_draft=cu.float()), TypeError, "cu_num_draft must be int32 or int64"),
        (dict(cu_num_draft=cu, num_draft=torch.tensor([1, 1, 1])), ValueError, "cannot both be given"),
        (dict(cu_num_draft=cu, target_logits=zf[:6]), ValueError, "target_logits must have shape (T + B, V)"),
        (dict(cu_num_draft=cu, draft_probs=qf[:3]), ValueError, "draft_probs must have shape"),
        (dict(cu_num_draft=cu, uniforms=uf[:6]), ValueError, "uniforms must have shape"),
    ]
    for fn in (ragattn.verify_draft, OP):
        for kw, exc, msg in cases:
            args = dict(draft_tokens=xf, draft_probs=qf, target_logits=zf, uniforms=uf)
            args.update(kw)
            with pytest.raises(exc, match="ragattn.verify_draft") as info:
                fn(**args)
            assert msg in str(info.value), str(info.value)


@pytest.mark.parametrize("case", range(20))
def test_fake_validates_like_the_op(case):
    """The fake impl (meta tensors through torch.ops) raises what the C++ op raises, except the
    value checks that need the data (a documented CUDA precondition)."""
    (tensors, extra), exc, msg = _bad_inputs()[case]
    if any(w in msg for w in ("draft_tokens must be in", "uniforms must be in", "num_draft must be in")):
        pytest.skip("value check: needs the data")
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in {**tensors, **extra}.items()}
    with pytest.raises(exc, match="ragattn.verify_draft") as info:
        OP(**meta)
    assert msg in str(info.value)
    out, n = OP(*(t.to("meta") for t in make_case(3, 4, 50)))
    assert out.shape == (3, 5) and n.dtype == torch.int32


def test_opcheck_engine_layouts(device):
    x, q, z, u = make_case(3, 4, 50)
    nd = torch.tensor([0, 2, 4])
    cu, xf, qf, zf, uf, _ = _flatten(x, q, z, u, nd)
    dev = [t.to(device) for t in (xf, qf, zf, uf)]
    torch.library.opcheck(OP.default, (dev[0], dev[1], dev[2], dev[3]), {"eta": 2.0, "cu_num_draft": cu.to(device)})
    torch.library.opcheck(OP.default, (dev[0], None, dev[2], dev[3]), {"cu_num_draft": cu.to(device)})
    torch.library.opcheck(OP.default, (x.to(device), None, z.to(device), u.to(device)), {"eta": 3.0})


@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_mode(device, monkeypatch, backend):
    """Serving code runs under torch.inference_mode(): every layout, every backend."""
    use_kernel_backend(monkeypatch, device, backend)
    x, q, z, u = make_case(4, 3, 64)
    nd = torch.tensor([3, 0, 1, 2])
    cu, xf, qf, zf, uf, _ = _flatten(x, q, z, u, nd)
    with torch.inference_mode():
        a = run(x, q, z, u, device, eta=2.0, num_draft=nd.to(device))
        b = run(x, None, z, u, device, greedy=True)
        c = ragattn.verify_draft(xf.to(device), None, zf.to(device), uf.to(device), cu_num_draft=cu.to(device))
    check_structure(*a, x, nd)
    assert b[0].shape == (4, 4) and c[0].shape == (zf.shape[0],)


def test_benchmark_bytes_are_what_a_call_touches(monkeypatch):
    """The benchmark counts the bytes the kernel must read and write, from the
    call's own num_accepted: the CUDA kernel reads every position's target-logits row whatever the
    acceptance (its first phase covers all g + 1 positions at once), the draft-probs rows of every
    drafted position with eta > 0 and only the rejected position's row with eta = 0 (never every row
    of both tensors twice, which made "% of peak" able to pass 100%)."""
    from ragattn.bench import bench_verify_draft as bench

    for accepted in ("none", "all"):
        def fake_verify(x, q, z, u, eta=0.0, _a=accepted):
            n = torch.zeros(x.shape[0], dtype=torch.int32) if _a == "none" else torch.full((x.shape[0],), x.shape[1], dtype=torch.int32)
            return torch.zeros(x.shape[0], x.shape[1] + 1, dtype=torch.int64), n

        monkeypatch.setattr(ragattn, "verify_draft", fake_verify)
        for case in (c for spec in bench.cases(torch.device("cpu"), "cpu") for c in spec.build_all()):
            b, g, v = (int(t[1:]) for t in case.name.split("_")[:3])
            small = b * 1024   # drafts, uniforms, outputs: a few hundred bytes per row
            if case.params["eta"] > 0:  # every drafted row's draft probs (max q, p_hat), accepted or not
                probs_rows = g
            else:  # the residual's row at a rejection; the draft tokens' single entries otherwise
                probs_rows = 1 if accepted == "none" else 0
            want = b * v * ((g + 1) * 2 + probs_rows * 4)
            assert want <= case.bytes <= want + small, case.name
