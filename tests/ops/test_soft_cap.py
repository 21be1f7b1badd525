"""``logits_soft_cap`` (Gemma 2's attn_logit_softcapping, FlashInfer's name) in varlen_attention
and paged_attention on every backend: each score, after scale and before the mask, becomes
``cap * tanh(score / cap)``; 0 is off. Against the float64 reference on awkward sizes (GQA, an
empty and a length-1 sequence, head_dim 80 and 256), forward and backward, validation, fakes."""
import math

import pytest
import torch

import ragattn
from ragattn.reference.paged_attention import paged_attention as ref_paged
from ragattn.reference import varlen_attention as ref_varlen
from tests.helpers import assert_precision, poison_like, randn_nonzero, use_kernel_backend
from tests.ops.test_varlen_attention import _case, _float64

CAP = 2.5
SCALE = 0.35   # scores ~ N(0, (0.35 sqrt(D))^2): far past the cap, the tanh's curved part matters


def _varlen_args(device, dtype, D, mask="chunks", causal=True, ratio=3, seed=0):
    lens = [29, 0, 41, 1]
    return _case(lens, lens, 2 * ratio, 2, D, dtype, device, blocks=mask, causal=causal,
                 gen=torch.Generator().manual_seed(seed))


def test_reference_caps_the_scores():
    """The reference's own meaning: one query, two keys, by hand."""
    q = torch.tensor([[[2.0, 0.0]]], dtype=torch.float64)
    k = torch.tensor([[[3.0, 0.0]], [[-1.0, 0.0]]], dtype=torch.float64)
    v = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=torch.float64)
    cu_q, cu_k = torch.tensor([0, 1]), torch.tensor([0, 2])
    out, lse = ref_varlen(q, k, v, cu_q, cu_k, torch.tensor([1]), None, None, None, True, 1.0, -1, 4.0)
    s = 4.0 * torch.tanh(torch.tensor([6.0, -2.0], dtype=torch.float64) / 4.0)
    p = torch.softmax(s, 0)
    torch.testing.assert_close(out[0, 0], p[0] * v[0, 0] + p[1] * v[1, 0])
    torch.testing.assert_close(lse[0, 0], torch.logsumexp(s, 0).float())


@pytest.mark.parametrize("backend", ["default", "triton", "reference"])
@pytest.mark.parametrize("dtype, D, mask, causal", [
    (torch.float32, 64, "chunks", True),
    (torch.bfloat16, 256, "none", True),
    (torch.float16, 80, "many", False),
    (torch.float32, 256, "random", False),
])
def test_varlen_forward_matches_reference(device, backend, monkeypatch, dtype, D, mask, causal):
    use_kernel_backend(monkeypatch, device, backend)
    args = list(_varlen_args(device, dtype, D, mask, causal))
    rest = dict(scale=SCALE, logits_soft_cap=CAP)
    out, lse = ragattn.varlen_attention(*args, **rest)
    o64, l64 = ref_varlen(*_float64(args), SCALE, -1, CAP)
    o_lp, l_lp = ref_varlen(*args, SCALE, -1, CAP, upcast=False)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_precision(out, o64, o_lp, what="out")
    assert_precision(lse, l64, l_lp, what="lse")
    # the cap matters at these scores: without it the result is far from the capped one
    plain, _ = ref_varlen(*_float64(args), SCALE)
    assert (plain - o64).abs().max() > 0.05
    # out= into poisoned buffers, the same result
    o2, l2 = poison_like(out), poison_like(lse)
    ragattn.varlen_attention(*args, **rest, out=o2, lse_out=l2)
    torch.testing.assert_close(o2, out, rtol=0, atol=0)
    torch.testing.assert_close(l2, lse, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["default", "triton"])
@pytest.mark.parametrize("dtype, D, mask, causal, window", [
    (torch.float32, 64, "chunks", True, -1),
    (torch.bfloat16, 256, "none", True, 9),
    (torch.float16, 80, "random", False, -1),
])
def test_varlen_gradients_match_reference(device, backend, monkeypatch, dtype, D, mask, causal, window):
    use_kernel_backend(monkeypatch, device, backend)
    args = list(_varlen_args(device, dtype, D, mask, causal, seed=4))
    dout = randn_nonzero(*args[0].shape, dtype=dtype, device=device, generator=torch.Generator().manual_seed(5))

    def grads(fn, tensors, rest, d, **kw):
        leaves = [t.detach().requires_grad_(True) for t in tensors]
        out = fn(*leaves, *rest, SCALE, window, CAP, **kw)[0]
        return torch.autograd.grad(out, leaves, d)

    got = grads(ragattn.varlen_attention, args[:3], args[3:], dout)
    want64 = grads(ref_varlen, _float64(args[:3]), args[3:], dout.double())
    want_lp = grads(ref_varlen, args[:3], args[3:], dout, upcast=False)
    plain = grads(lambda *a: ref_varlen(*a[:-1], 0.0), _float64(args[:3]), args[3:], dout.double())
    for name, g, w64, wlp, p in zip(("dq", "dk", "dv"), got, want64, want_lp, plain):
        assert_precision(g, w64, wlp, what=name)
        if name != "dv":
            assert (p - w64).abs().max() > 1e-2   # the tanh's derivative is in there


def test_varlen_kernels_small_tiles_with_cap(device):
    """16-row tiles and no mask, so the forward, dq and dk/dv kernels run capped scores
    through their loops of whole tiles (the soft-cap backward there ran in no other test) as well as
    the masked ones of the partial last tiles; GQA 3, an empty and a length-1 sequence; vs the
    float64 reference."""
    from ragattn.triton_kernels.varlen_attention import varlen_attention_bwd, varlen_attention_fwd
    from tests.helpers import require_triton_on

    require_triton_on(device)
    args = _varlen_args(device, torch.float32, 64, "none", False, seed=6)
    out, lse = poison_like(args[0]), poison_like(args[0][..., 0].float())
    varlen_attention_fwd(*args, SCALE, block_m=16, block_n=16, out=out, lse=lse, logits_soft_cap=CAP)
    o64, l64 = ref_varlen(*_float64(args), SCALE, -1, CAP)
    o32, l32 = ref_varlen(*args, SCALE, -1, CAP, upcast=False)
    assert_precision(out, o64, o32, what="out")
    assert_precision(lse, l64, l32, what="lse")
    dout = randn_nonzero(*out.shape, device=device, generator=torch.Generator().manual_seed(7))
    got = varlen_attention_bwd(dout, *args[:3], out, lse, *args[3:], SCALE, block_m=16, block_n=16,
                               logits_soft_cap=CAP)
    for what, up, tensors in (("64", True, _float64(args[:3])), ("32", False, args[:3])):
        leaves = [t.detach().requires_grad_(True) for t in tensors]
        ref = torch.autograd.grad(ref_varlen(*leaves, *args[3:], SCALE, -1, CAP, upcast=up)[0], leaves,
                                  dout.double() if up else dout)
        if up:
            want64 = ref
        else:
            want32 = ref
    for name, g, w64, w32 in zip(("dq", "dk", "dv"), got, want64, want32):
        assert_precision(g, w64, w32, what=name)


def _paged_case(device, dtype, D, seed=0, page=5):
    g = torch.Generator().manual_seed(seed)
    lens, rows = [23, 0, 1, 17], [4, 0, 1, 3]
    hkv, H = 2, 6
    pages_per = [math.ceil(n / page) for n in lens]
    num_pages = sum(pages_per) + 3
    k_cache = randn_nonzero(num_pages, page, hkv, D, dtype=dtype, device=device, generator=g)
    v_cache = randn_nonzero(num_pages, page, hkv, D, dtype=dtype, device=device, generator=g)
    perm = torch.randperm(num_pages, generator=g)
    table = torch.zeros(len(lens), max(pages_per), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    q_pos = torch.cat([torch.randint(0, max(n, 1) + 2, (r,), generator=g) for n, r in zip(lens, rows)]).to(torch.int32)
    q = randn_nonzero(sum(rows), H, D, dtype=dtype, device=device, generator=g)
    cu = torch.tensor([0] + torch.tensor(rows).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return (q, q_pos.to(device), cu, k_cache, v_cache, table.to(device),
            torch.tensor(lens, dtype=torch.int32, device=device))


@pytest.mark.parametrize("backend", ["default", "triton", "reference"])
@pytest.mark.parametrize("dtype, D, window", [(torch.float32, 64, -1), (torch.bfloat16, 256, 6),
                                              (torch.float16, 80, -1)])
def test_paged_matches_reference(device, backend, monkeypatch, dtype, D, window):
    use_kernel_backend(monkeypatch, device, backend)
    args = _paged_case(device, dtype, D)
    out, lse = ragattn.paged_attention(*args, SCALE, window, CAP)
    a64 = [t.double() if t.is_floating_point() else t for t in args]
    o64, l64 = ref_paged(*a64, SCALE, window, logits_soft_cap=CAP)
    o_lp, l_lp = ref_paged(*args, SCALE, window, logits_soft_cap=CAP, compute_dtype=dtype)
    assert_precision(out, o64, o_lp, what="out")
    assert_precision(lse, l64.float(), l_lp.float(), what="lse")
    plain, _ = ref_paged(*a64, SCALE, window)
    assert (plain - o64).abs().max() > 0.05
    o2, l2 = poison_like(out), poison_like(lse)
    ragattn.paged_attention(*args, SCALE, window, CAP, out=o2, lse_out=l2)
    torch.testing.assert_close(o2, out, rtol=0, atol=0)
    torch.testing.assert_close(l2, lse, rtol=0, atol=0)


def test_zero_cap_is_bit_identical_to_no_cap(device):
    args = list(_varlen_args(device, torch.float32, 64))
    a = ragattn.varlen_attention(*args)
    b = ragattn.varlen_attention(*args, logits_soft_cap=0.0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    pargs = _paged_case(device, torch.float32, 64)
    a = ragattn.paged_attention(*pargs)
    b = ragattn.paged_attention(*pargs, None, -1, 0.0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("backend", ["default", "reference", "meta"])
def test_bad_cap_is_a_named_value_error(monkeypatch, bad, backend):
    dev = torch.device("meta" if backend == "meta" else "cpu")
    if backend == "reference":
        monkeypatch.setenv("RAGATTN_CPU_BACKEND", "reference")
    args = list(_varlen_args(torch.device("cpu"), torch.float32, 64))
    args = [a.to(dev) if torch.is_tensor(a) else a for a in args]
    with pytest.raises(ValueError, match="varlen_attention: logits_soft_cap must be finite and >= 0"):
        ragattn.varlen_attention(*args, logits_soft_cap=bad)
    pargs = [a.to(dev) for a in _paged_case(torch.device("cpu"), torch.float32, 64)]
    with pytest.raises(ValueError, match="paged_attention: logits_soft_cap must be finite and >= 0"):
        ragattn.paged_attention(*pargs, None, -1, bad)
    with pytest.raises(TypeError, match="logits_soft_cap must be a float"):
        ragattn.varlen_attention(*args, logits_soft_cap="2")


def test_opcheck_with_soft_cap(device):
    args = list(_varlen_args(device, torch.float32, 64, mask="chunks"))
    torch.library.opcheck(torch.ops.ragattn.varlen_attention.default, (*args, SCALE, -1, CAP))
    leaves = [t.detach().requires_grad_(True) for t in args[:3]]
    torch.library.opcheck(torch.ops.ragattn.varlen_attention.default, (*leaves, *args[3:], SCALE, 4, CAP),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    pargs = _paged_case(device, torch.float32, 64)
    torch.library.opcheck(torch.ops.ragattn.paged_attention.default, (*pargs, SCALE, -1, CAP))


def test_schema_defaults_keep_old_callers():
    """Existing callers (positional up to window_left) keep working: the new argument defaults to 0."""
    for op in (torch.ops.ragattn.varlen_attention.default, torch.ops.ragattn.paged_attention.default,
               torch.ops.ragattn.varlen_attention_backward.default):
        arg = next(a for a in op._schema.arguments if a.name == "logits_soft_cap")
        assert arg.default_value == 0.0


@pytest.mark.parametrize("backend", ["default", "triton"])
@pytest.mark.parametrize("cap", [0.5, 2.5, 50.0])
def test_soft_cap_across_tanh_regimes(device, backend, monkeypatch, cap):
    """Scores from -6 cap to 6 cap, tiny ones and both sides of 0.25 cap (where the C++ kernel's
    vector tanh changes formula): out and lse within the precision rule of the fp32 reference."""
    use_kernel_backend(monkeypatch, device, backend)
    vals = torch.cat([torch.linspace(-60, 60, 301), torch.tensor([1e-6, -1e-6, 2.499, 2.501, -2.5, 1e-2])]) * cap / 10
    D = 16
    q = torch.zeros(1, 1, D, device=device)
    q[0, 0, 0] = 1.0
    k = randn_nonzero(len(vals), 1, D, device=device, generator=torch.Generator().manual_seed(2)) * 1e-3
    k[:, 0, 0] = vals.to(device)
    v = randn_nonzero(len(vals), 1, D, device=device, generator=torch.Generator().manual_seed(3))
    cu_q = torch.tensor([0, 1], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, len(vals)], dtype=torch.int32, device=device)
    args = (q, k, v, cu_q, cu_k, torch.tensor([10**6], dtype=torch.int32, device=device), None, None, None, True,
            1.0, -1, cap)
    out, lse = ragattn.varlen_attention(*args)
    o64, l64 = ref_varlen(*_float64(args))
    o32, l32 = ref_varlen(*args)
    assert_precision(out, o64, o32, what="out")
    assert_precision(lse, l64, l32, what="lse")
