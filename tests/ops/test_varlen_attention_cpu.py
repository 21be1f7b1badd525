"""varlen_attention's default CPU forward and backward in C++ (csrc/attention/varlen_attention_cpu.cpp,
the private ops ragattn::_varlen_attention_cpu and _varlen_attention_backward_cpu): the kernels on the
cases they own (tiles of 4 query rows, steps of 64 listed keys, sorted and unsorted kv_pos, blocks),
their edge rules, thread-count independence, and errors against the fake impl's and the reference
route's."""
from __future__ import annotations

import pytest
import torch

import ragattn
from ragattn.reference import varlen_attention as ref_varlen
from tests.helpers import assert_precision, max_abs_err, poison_like, randn_nonzero, use_kernel_backend
from tests.ops.paged_attention.test_paged_attention_cpu import _error

CPU_OP = torch.ops.ragattn._varlen_attention_cpu
CPU_BWD = torch.ops.ragattn._varlen_attention_backward_cpu
I32 = torch.int32
TILE, STEP = 4, 64  # the kernel's kTileRows and kChunk


def _offsets(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=I32)


def _inputs(lens_q, lens_k, H, Hkv, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = randn_nonzero(sum(lens_q), H, D, dtype=dtype, generator=g)
    k = randn_nonzero(sum(lens_k), Hkv, D, dtype=dtype, generator=g)
    v = randn_nonzero(sum(lens_k), Hkv, D, dtype=dtype, generator=g)
    return q, k, v, _offsets(lens_q), _offsets(lens_k), g


def _perm_pos(lens, g):
    """Unsorted positions: a permutation of arange per sequence (kv_pos not ascending)."""
    return torch.cat([torch.randperm(n, generator=g) for n in lens] + [torch.zeros(0, dtype=torch.long)]).to(I32)


def _blocks(lens, g, n_ids=3):
    """Block ids in runs (chunks) with global (-1) tokens at the start and scattered."""
    out = []
    for n in lens:
        b = torch.randint(0, n_ids, (n,), generator=g).repeat_interleave(5)[:n] if n else torch.zeros(0, dtype=torch.long)
        b[: min(3, n)] = -1
        b[torch.rand(n, generator=g) < 0.1] = -1
        out.append(b)
    return torch.cat(out + [torch.zeros(0, dtype=torch.long)]).to(I32)


def _float64(args):
    return [a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]


def _check(args, what="", cpp=True):
    """The op (default CPU path) against the float64 reference, FlashAttention's precision rule,
    and (``cpp``) bit for bit the C++ kernel's result; returns (out, lse)."""
    out, lse = ragattn.varlen_attention(*args)
    o64, l64 = ref_varlen(*_float64(args))
    o_lp, l_lp = ref_varlen(*args, upcast=False)
    assert out.dtype == args[0].dtype and out.shape == args[0].shape and lse.shape == args[0].shape[:2]
    assert torch.isfinite(out).all() and not torch.isnan(lse).any(), what
    assert_precision(out, o64, o_lp, what=f"out {what}")
    assert_precision(lse, l64, l_lp, what=f"lse {what}")
    dead = torch.isneginf(l64)
    assert torch.equal(torch.isneginf(lse), dead), what
    assert (out[dead] == 0).all(), what
    if cpp:  # the public op's default CPU forward is this kernel, bit for bit
        o2, l2 = CPU_OP(*args)
        assert torch.equal(o2, out) and torch.equal(l2, lse)
    return out, lse


# (lens_q, lens_k, H, Hkv, D, dtype, pos, blocks, causal, window): awkward sizes around the
# kernel's tile (4 rows) and step (64 keys), empty and length-1 sequences, GQA 1/3/4, head dims
# that are not multiples of 8
CASES = {
    "window unsorted kv_pos": ([37, 1, 0, 70], [37, 1, 0, 70], 6, 2, 40, torch.float32, "perm", False, True, 6),
    "window sorted, offset q": ([9, 66], [130, 66], 3, 1, 64, torch.float32, "offset", False, True, 31),
    "blocks with globals": ([45, 0, 7, 1], [45, 3, 7, 1], 6, 2, 37, torch.float32, "default", True, True, -1),
    "blocks unsorted, window": ([29, 13], [29, 17], 4, 4, 64, torch.float32, "perm", True, True, 9),
    "non-causal blocks": ([23, 5], [31, 5], 3, 1, 72, torch.float32, "default", True, False, -1),
    "non-causal long": ([5, 3], [150, 2], 4, 2, 24, torch.float32, "default", False, False, -1),
    "gqa3 fp16": ([33, 6], [33, 70], 6, 2, 64, torch.float16, "default", True, True, 20),
    "bf16 unsorted": ([19, 2], [40, 2], 8, 2, 96, torch.bfloat16, "perm", False, True, -1),
    "window 0": ([11], [11], 2, 1, 8, torch.float32, "default", False, True, 0),
}


def _case_args(name):
    lens_q, lens_k, H, Hkv, D, dtype, pos, blocks, causal, window = CASES[name]
    q, k, v, cu_q, cu_k, g = _inputs(lens_q, lens_k, H, Hkv, D, dtype, seed=len(name))
    q_pos = kv_pos = q_blk = kv_blk = None
    if pos == "perm":
        q_pos = torch.randint(0, max(lens_k) + 2, (q.shape[0],), generator=g).to(I32)
        kv_pos = _perm_pos(lens_k, g)
    elif pos == "offset":
        q_pos = torch.cat([torch.arange(lk - lq, lk) for lq, lk in zip(lens_q, lens_k)]).to(I32)
    if blocks:
        q_blk, kv_blk = _blocks(lens_q, g), _blocks(lens_k, g)
    return (q, k, v, cu_q, cu_k, q_pos, kv_pos, q_blk, kv_blk, causal, None, window), g


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name):
    _check(_case_args(name)[0], name)


@pytest.mark.parametrize("name", list(CASES))
def test_backward_matches_reference(name):
    """dq, dk, dv through the op's autograd (the C++ backward) against the float64 reference's
    autograd, FlashAttention's precision rule; the public backward op is the C++ one bit for bit."""
    args, g = _case_args(name)
    leaves = [t.detach().requires_grad_(True) for t in args[:3]]
    out, lse = ragattn.varlen_attention(*leaves, *args[3:])
    dout = randn_nonzero(*out.shape, dtype=out.dtype, generator=g)
    got = torch.autograd.grad(out, leaves, dout)
    l64 = [t.double().requires_grad_(True) for t in args[:3]]
    want64 = torch.autograd.grad(ref_varlen(*l64, *args[3:])[0], l64, dout.double(), allow_unused=True)
    llp = [t.detach().requires_grad_(True) for t in args[:3]]
    want_lp = torch.autograd.grad(ref_varlen(*llp, *args[3:], upcast=False)[0], llp, dout, allow_unused=True)
    for what, gr, w64, wlp, t in zip(("dq", "dk", "dv"), got, want64, want_lp, args[:3]):
        w64 = torch.zeros_like(t, dtype=torch.float64) if w64 is None else w64
        wlp = torch.zeros_like(t) if wlp is None else wlp
        assert gr.dtype == t.dtype and gr.shape == t.shape
        assert torch.isfinite(gr).all(), what
        assert_precision(gr, w64, wlp, what=f"{what} {name}")
    direct = CPU_BWD(dout, *args[:3], out.detach(), lse, *args[3:])
    assert all(torch.equal(a, b) for a, b in zip(direct, got))


def test_int64_index_tensors_and_int32_limit_positions():
    """Positions at the int32 limits (no wrap: the kernel compares in int64), int64 index tensors."""
    q, k, v, cu_q, cu_k, g = _inputs([6, 5], [9, 5], 4, 2, 64, torch.float32, seed=4)
    top, bottom = 2**31 - 1, -(2**31)
    q_pos = torch.tensor([top] * 3 + [top - 1, top - 4, bottom] + [bottom + i for i in range(5)])
    kv_pos = torch.tensor([top - i for i in range(9)] + [bottom + 4 - i for i in range(5)])
    for window in (-1, 2, 2**31 - 1):
        args = (q, k, v, cu_q.long(), cu_k.long(), q_pos, kv_pos, None, None, True, None, window)
        out, lse = _check(args, f"window {window}")
        assert torch.isfinite(lse[:5]).all()  # the top rows see keys (q_pos + 1 would wrap in int32)


def test_masked_nonfinite_never_read():
    """NaN/inf in keys a row cannot see (window, blocks, unsorted positions, keys shared with the
    other rows of its tile) leave that row bit-identical to the clean run."""
    q, k, v, cu_q, cu_k, g = _inputs([50, 21], [50, 21], 4, 2, 64, torch.float32, seed=5)
    kv_pos = _perm_pos([50, 21], g)
    blk = _blocks([50, 21], g)
    args = [q, k, v, cu_q, cu_k, kv_pos.clone(), kv_pos, blk, blk, True, None, 12]
    clean_o, clean_l = ragattn.varlen_attention(*args)
    vis = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)  # packed visibility
    from ragattn.reference.varlen_attention import visible_mask
    for b in range(2):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        vis[qs:qe, ks:ke] = visible_mask(args[5][qs:qe], kv_pos[ks:ke], blk[qs:qe], blk[ks:ke], True, 12)
    bad = torch.tensor([3, 17, 40, 55])
    kp, vp = k.clone(), v.clone()
    kp[bad] = float("nan")
    vp[bad[:2]] = float("inf")
    vp[bad[2:]] = float("nan")
    out, lse = ragattn.varlen_attention(q, kp, vp, *args[3:])
    blind = ~vis[:, bad].any(1)
    assert blind.sum() > 10 and (~blind).sum() > 3
    assert torch.equal(out[blind], clean_o[blind]) and torch.equal(lse[blind], clean_l[blind])
    assert not torch.isfinite(out[~blind]).all(dim=(1, 2)).any()  # rows that see one are not finite
    # the backward: a blind row's dq is the clean run's, bit for bit
    dout = randn_nonzero(*out.shape, generator=g)
    clean_dq = CPU_BWD(dout, q, k, v, clean_o, clean_l, *args[3:])[0]
    dq = CPU_BWD(dout, q, kp, vp, out, lse, *args[3:])[0]
    assert torch.equal(dq[blind], clean_dq[blind])


def test_visible_nonfinite_follows_the_reference():
    """-inf scores weigh 0 (finite result, as in the reference); +inf or NaN scores poison the
    (row, head); a visible inf in V makes that dim non-finite; a row whose visible scores are all
    -inf gets out 0 and lse -inf like the reference."""
    q, k, v, cu_q, cu_k, g = _inputs([12], [12], 2, 1, 16, torch.float32, seed=6)
    k[:, 0, 0] = k[:, 0, 0].abs() + 0.5
    q[2, 0, 0] = float("-inf")  # row 2 head 0: every score -inf
    q[3, 0, 1] = float("inf")  # row 3 head 0: scores +-inf
    k[5, 0, 2] = float("-inf")  # key 5: -inf or +inf scores for the rows after it
    v[7, 0, 3] = float("inf")
    args = (q, k, v, cu_q, cu_k, None, None, None, None, True, None, -1)
    out, lse = ragattn.varlen_attention(*args)
    o64, l64 = ref_varlen(*_float64(args))
    o_fin, l_fin = torch.isfinite(o64), torch.isfinite(l64)
    assert torch.equal(torch.isfinite(out), o_fin) and torch.equal(torch.isfinite(lse), l_fin)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(l64))
    assert max_abs_err(out[o_fin], o64[o_fin].float()) < 1e-5 and max_abs_err(lse[l_fin], l64[l_fin]) < 1e-5
    assert (out[2, 0] == 0).all() and lse[2, 0] == float("-inf") and l64[2, 0] == float("-inf")
    assert not l_fin.all() and o_fin.sum() > 0.5 * o_fin.numel()  # the test exercises both sides


def test_rows_that_see_no_key():
    """out 0 and lse -inf: causal rows before every key, an empty key sequence, a window past every key."""
    q, k, v, cu_q, cu_k, g = _inputs([5, 3, 4], [6, 0, 4], 4, 2, 32, torch.float32, seed=7)
    q_pos = torch.tensor([0, 1, 9, 10, 11, 0, 0, 0, 50, 51, 52, 3], dtype=I32)
    kv_pos = torch.tensor([2, 3, 4, 5, 6, 7, 0, 1, 2, 3], dtype=I32)
    args = (q, k, v, cu_q, cu_k, q_pos, kv_pos, None, None, True, None, 30)
    out, lse = _check(args, "no key")
    dead = torch.tensor([1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0], dtype=torch.bool)
    assert torch.isneginf(lse[dead]).all() and torch.isfinite(lse[~dead]).all() and (out[dead] == 0).all()
    dq, dk, dv = CPU_BWD(randn_nonzero(*q.shape, generator=g), q, k, v, out, lse, *args[3:])
    assert (dq[dead] == 0).all() and (dq[~dead] != 0).all()
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))


def test_results_do_not_depend_on_the_thread_count():
    q, k, v, cu_q, cu_k, g = _inputs([150, 61], [150, 61], 6, 2, 64, torch.float32, seed=8)
    blk = _blocks([150, 61], g)
    args = (q, k, v, cu_q, cu_k, None, None, blk, blk, True, None, 40)
    dout = randn_nonzero(*q.shape, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        o1, l1 = CPU_OP(*args)
        g1 = CPU_BWD(dout, *args[:3], o1, l1, *args[3:])
        torch.set_num_threads(2)
        o2, l2 = CPU_OP(*args)
        g2 = CPU_BWD(dout, *args[:3], o1, l1, *args[3:])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    # and a row's result does not depend on the other sequences of the call
    one = torch.tensor([0, 61], dtype=I32)
    o_alone, _ = CPU_OP(q[150:], k[150:], v[150:], one, one, None, None, blk[150:], blk[150:], True, None, 40)
    assert torch.equal(o_alone, o1[150:])


def test_out_variant_and_inference_mode():
    q, k, v, cu_q, cu_k, g = _inputs([13, 4], [13, 9], 4, 2, 64, torch.bfloat16, seed=9)
    blk = _blocks([13, 4], g), _blocks([13, 9], g)
    with torch.inference_mode():
        out, lse = ragattn.varlen_attention(q, k, v, cu_q, cu_k, None, None, *blk, True, 0.2, 5)
        o_buf, l_buf = poison_like(out), poison_like(lse)
        ragattn.varlen_attention(q, k, v, cu_q, cu_k, None, None, *blk, True, 0.2, 5, out=o_buf, lse_out=l_buf)
    assert torch.equal(o_buf, out) and torch.equal(l_buf, lse)


def test_opcheck_private_ops():
    q, k, v, cu_q, cu_k, g = _inputs([9, 0, 12], [9, 4, 12], 6, 2, 40, torch.float32, seed=10)
    blk = _blocks([9, 0, 12], g), _blocks([9, 4, 12], g)
    index = (cu_q, cu_k, None, None, *blk, True, 0.3, 4)
    torch.library.opcheck(CPU_OP.default, (q, k, v, *index))
    out, lse = CPU_OP(q, k, v, *index)
    torch.library.opcheck(CPU_BWD.default, (randn_nonzero(*q.shape, generator=g), q, k, v, out, lse, *index))


def _good():
    q, k, v, cu_q, cu_k, g = _inputs([5, 6], [5, 7], 4, 2, 64, torch.float32, seed=11)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


# the checks that read index values: the C++ path against the reference route (Python's)
VALUE_ERRORS = {
    "cu_q start": lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"] + 1),
    "cu_k end": lambda a: a.update(cu_seqlens_k=torch.tensor([0, 5, 11], dtype=I32)),
    "cu_q order": lambda a: a.update(cu_seqlens_q=torch.tensor([0, 7, 5, 11], dtype=I32),
                                     cu_seqlens_k=torch.tensor([0, 5, 5, 12], dtype=I32)),
    "q_pos int64": lambda a: a.update(q_pos=torch.arange(11) + 2**31),
    "kv_pos int64": lambda a: a.update(kv_pos=torch.arange(12) - 2**31 - 1),
    "q_block int64": lambda a: a.update(q_block=torch.full((11,), 2**33)),
    "kv_block int64": lambda a: a.update(kv_block=torch.full((12,), -(2**40))),
}
# the checks that read no values: the real op against the fake impl
META_ERRORS = {
    "q dtype": lambda a: a.update(q=a["q"].long()),
    "k dtype": lambda a: a.update(k=a["k"].half()),
    "v shape": lambda a: a.update(v=a["v"][:, :, :32]),
    "heads": lambda a: a.update(q=a["q"][:, :3]),
    "q_pos shape": lambda a: a.update(q_pos=torch.zeros(3, dtype=I32)),
    "kv_block dtype": lambda a: a.update(kv_block=torch.zeros(12)),
    "window": lambda a: a.update(window_left=-2),
}


def _backward_call(a):
    """The backward op on a's inputs (dout, out and lse: any values of the right shapes)."""
    q = a["q"]
    idx = [a.get(n) for n in ("cu_seqlens_q", "cu_seqlens_k", "q_pos", "kv_pos", "q_block", "kv_block")]
    return torch.ops.ragattn.varlen_attention_backward(q, q, a["k"], a["v"], q, torch.zeros(q.shape[:2]), *idx, True,
                                                       None)


@pytest.mark.parametrize("name", list(VALUE_ERRORS))
def test_value_errors_match_the_reference_route(name, monkeypatch):
    a = _good()
    VALUE_ERRORS[name](a)
    got = _error(lambda: ragattn.varlen_attention(**a)), _error(lambda: _backward_call(a))
    use_kernel_backend(monkeypatch, torch.device("cpu"), "reference")
    want = _error(lambda: ragattn.varlen_attention(**a)), _error(lambda: _backward_call(a))
    assert got[0] is not None and got == want


def test_metadata_errors_match_the_fake_impl():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name, mutate in META_ERRORS.items():
        a = _good()
        mutate(a)
        got = _error(lambda: ragattn.varlen_attention(**a))
        with FakeTensorMode() as mode:
            fa = {n: mode.from_tensor(t) if torch.is_tensor(t) else t for n, t in a.items()}
            want = _error(lambda: ragattn.varlen_attention(**fa))
        assert got is not None and got == want, name


def test_dense_float32_calls_take_the_fused_path():
    """Non-causal, unwindowed, unblocked float32 calls of enough pairs run torch's fused kernel
    (faster there, see _dense_sdpa_wins); same results within the precision rule, out= too."""
    import sys

    mod = sys.modules["ragattn.ops.varlen_attention"]
    lens = [64, 1, 0, 50, 47]
    q, k, v, cu_q, cu_k, g = _inputs(lens, lens, 6, 2, 40, torch.float32, seed=12)
    args = (q, k, v, cu_q, cu_k, None, None, None, None, False, None, -1)
    assert mod._dense_sdpa_wins(q, k, cu_q, cu_k, None, None, False, -1)
    assert not mod._dense_sdpa_wins(q, k, cu_q, cu_k, None, None, True, -1)
    assert not mod._dense_sdpa_wins(q.bfloat16(), k, cu_q, cu_k, None, None, False, -1)
    out, lse = _check(args, "dense", cpp=False)
    o_buf, l_buf = poison_like(out), poison_like(lse)
    ragattn.varlen_attention(*args, out=o_buf, lse_out=l_buf)
    assert torch.equal(o_buf, out) and torch.equal(l_buf, lse)


@pytest.mark.parametrize("backend", ["default", "reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("lens_k", [[0], [0, 0], [5], [3, 0, 4]])
def test_backward_with_no_query_rows_gives_zero_grads(monkeypatch, backend, dtype, lens_k):
    """No query row (with or without keys): every input that needs a gradient gets zeros of its
    own shape and dtype, never None, through backward() and autograd.grad alike."""
    use_kernel_backend(monkeypatch, torch.device("cpu"), backend)
    g = torch.Generator().manual_seed(11)
    q = torch.zeros(0, 4, 16, dtype=dtype, requires_grad=True)
    k, v = (randn_nonzero(sum(lens_k), 2, 16, dtype=dtype, generator=g).requires_grad_() for _ in range(2))
    cu_q = torch.zeros(len(lens_k) + 1, dtype=I32)
    for causal in (True, False):
        out, lse = ragattn.varlen_attention(q, k, v, cu_q, _offsets(lens_k), causal=causal)
        assert out.shape == q.shape and lse.shape == (0, 4)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        for grad, t in zip(grads, (q, k, v)):
            assert grad is not None and grad.shape == t.shape and grad.dtype == t.dtype and not grad.any()
    q.grad = k.grad = v.grad = None
    ragattn.varlen_attention(q, k, v, cu_q, _offsets(lens_k))[0].float().sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape and not t.grad.any() for t in (q, k, v))
