"""merge_attention_states vs the float64 reference and vs attention over the union of key sets."""
from __future__ import annotations

import pytest
import torch

import ragattn
from ragattn.reference.merge_attention_states import merge_attention_states as ref_merge
from tests.helpers import assert_precision, poison_like, randn_nonzero, run_compile_check, use_kernel_backend

I32 = torch.int32


@pytest.fixture(params=["default", "triton"])
def backend(request, monkeypatch, device):
    use_kernel_backend(monkeypatch, device, request.param)
    return request.param


def _states(n, h, d, dtype, device):
    out_a = randn_nonzero(n, h, d, dtype=dtype, device=device)
    out_b = randn_nonzero(n, h, d, dtype=dtype, device=device)
    lse_a = (3 * torch.randn(n, h)).to(device)
    lse_b = (3 * torch.randn(n, h)).to(device)
    return out_a, lse_a, out_b, lse_b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_random_states(backend, device, seed, dtype, head_dim):
    out_a, lse_a, out_b, lse_b = _states(37, 5, head_dim, dtype, device)
    # -inf on one side, on the other, on both
    lse_a[0] = float("-inf")
    lse_b[1] = float("-inf")
    lse_a[2, :2] = float("-inf")
    lse_b[2, :2] = float("-inf")
    out_a[0] = float("nan")  # a side that saw no key is ignored whatever its out holds
    out, lse = ragattn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    cpu = [t.cpu() for t in (out_a, lse_a, out_b, lse_b)]
    out64, lse64 = ref_merge(*[t.double() for t in cpu])
    out_lp, _ = ref_merge(*cpu)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_precision(out.cpu(), out64, out_lp, what="out")
    torch.testing.assert_close(lse.cpu().double(), lse64, atol=1e-6, rtol=1e-6)
    assert (out[2, :2] == 0).all() and torch.isinf(lse[2, :2]).all()
    torch.testing.assert_close(out[0].cpu().double(), out_b[0].cpu().double())


def test_edge_lse_rule(backend, device):
    """One rule on every backend: lse -inf or +inf (FlashAttention's empty-row marker) = saw no key,
    its out never read; NaN lse = NaN row; a read side's non-finite values give NaN, even at weight 0."""
    h, d = 3, 64
    out_a = randn_nonzero(7, h, d, device=device)
    out_b = randn_nonzero(7, h, d, device=device)
    lse_a = torch.randn(7, h).to(device)
    lse_b = torch.randn(7, h).to(device)
    lse_a[0] = float("inf")                              # a empty (FA marker): out = out_b
    out_a[0] = float("nan")
    lse_a[1], lse_b[1] = float("inf"), float("-inf")    # both empty, mixed markers
    out_a[1], out_b[1] = float("nan"), float("inf")
    lse_a[2, 0] = float("nan")                          # NaN lse: row 2 head 0 NaN
    lse_a[3], lse_b[3] = 0.0, -200.0                    # b weight underflows to 0 in fp32 ...
    out_b[3, :, 5] = float("nan")                       # ... but b is read: element 5 is NaN
    out_a[4, 1, 7] = float("inf")                       # a read side's inf: NaN, never inf
    out, lse = ragattn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    out, lse = out.cpu(), lse.cpu()
    ref_out, ref_lse = ref_merge(*[t.cpu() for t in (out_a, lse_a, out_b, lse_b)])
    torch.testing.assert_close(out, ref_out, equal_nan=True)
    torch.testing.assert_close(lse, ref_lse, equal_nan=True)
    torch.testing.assert_close(out[0], out_b[0].cpu())
    torch.testing.assert_close(lse[0], lse_b[0].cpu())
    assert (out[1] == 0).all() and (lse[1] == float("-inf")).all()
    assert torch.isnan(out[2, 0]).all() and torch.isnan(lse[2, 0]) and torch.isfinite(out[2, 1:]).all()
    assert torch.isnan(out[3, :, 5]).all() and torch.isfinite(out[3, :, :5]).all()
    assert torch.isnan(out[4, 1, 7]) and torch.isfinite(out[4, 1, :7]).all() and torch.isfinite(out[4, 0]).all()
    assert torch.isfinite(out[5:]).all() and torch.isfinite(lse[5:]).all()


def test_merge_of_two_halves_is_attention_over_the_whole(backend, device, seed):
    """Split each sequence's pages into two key sets (first pages / rest), attend to each, merge."""
    h, hkv, d, ps = 8, 2, 64, 16
    kv_len, rows = 50, [3, 20, 31, 40, 49]
    pages = torch.randperm(8).to(I32)
    k = randn_nonzero(8, ps, hkv, d, dtype=torch.float32, device=device)
    v = randn_nonzero(8, ps, hkv, d, dtype=torch.float32, device=device)
    q = randn_nonzero(len(rows), h, d, dtype=torch.float32, device=device)
    q_pos = torch.tensor(rows, dtype=I32, device=device)
    cu = torch.tensor([0, len(rows)], dtype=I32, device=device)
    bt_all = pages[None, :4].to(device)
    # shared prefix = first 2 pages (32 slots); private = the remaining slots, re-addressed as a
    # second "sequence" whose slot j is the whole sequence's slot 32 + j: shift q_pos by 32
    # (rows before 32 see no private key: lse -inf, which merge must handle)
    out_w, lse_w = ragattn.paged_attention(q, q_pos, cu, k, v, bt_all, torch.tensor([kv_len], dtype=I32, device=device))
    out_s, lse_s = ragattn.paged_attention(q, q_pos, cu, k, v, bt_all, torch.tensor([32], dtype=I32, device=device))
    shifted = torch.clamp(q_pos - 32, min=0)
    out_p, lse_p = ragattn.paged_attention(q, shifted, cu, k, v, pages[None, 2:4].to(device),
                                           torch.tensor([kv_len - 32], dtype=I32, device=device))
    before = q_pos < 32
    lse_p[before] = float("-inf")
    out_p[before] = 0
    out, lse = ragattn.merge_attention_states(out_s, lse_s, out_p, lse_p)
    torch.testing.assert_close(out, out_w, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, lse_w, atol=2e-5, rtol=2e-5)


def test_strided_states(backend, device, seed):
    """Outputs that are views (heads-major storage) merge like contiguous ones; results are contiguous."""
    out_a, lse_a, out_b, lse_b = _states(9, 4, 64, torch.float16, device)
    a_view = out_a.transpose(0, 1).contiguous().transpose(0, 1)
    lse_view = lse_b.t().contiguous().t()
    out, lse = ragattn.merge_attention_states(a_view, lse_a, out_b, lse_view)
    want, want_lse = ragattn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert out.is_contiguous() and lse.is_contiguous()
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)


def test_empty(backend, device):
    out_a, lse_a, out_b, lse_b = _states(0, 4, 64, torch.float16, device)
    out, lse = ragattn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


def test_preallocated_outputs_and_inference_mode(backend, device, seed):
    """out= / lse_out= (also strided views), under torch.inference_mode; overlap with an input refused."""
    with torch.inference_mode():
        args = _states(9, 4, 64, torch.bfloat16, device)
        want = ragattn.merge_attention_states(*args)
        out = torch.full_like(args[0], float("nan"))
        lse_wide = torch.full((9, 4, 3), float("nan"), device=device)
        got = ragattn.merge_attention_states(*args, out=out, lse_out=lse_wide[..., 1])
        assert got[0] is out
        torch.testing.assert_close(out, want[0], atol=0, rtol=0)
        torch.testing.assert_close(lse_wide[..., 1], want[1], atol=0, rtol=0)
        assert torch.isnan(lse_wide[..., 0]).all() and torch.isnan(lse_wide[..., 2]).all()
        with pytest.raises(ValueError, match="merge_attention_states: out must not share memory with out_a"):
            ragattn.merge_attention_states(*args, out=args[0])
        with pytest.raises(ValueError, match="merge_attention_states: lse_out must not share memory with lse_b"):
            ragattn.merge_attention_states(*args, lse_out=args[3])


def test_fake_validates_like_the_real_op():
    """A meta tensor among CPU tensors raises instead of returning garbage."""
    args = list(_states(5, 2, 64, torch.float16, "cpu"))
    for i in range(4):
        mixed = list(args)
        mixed[i] = mixed[i].to("meta")
        with pytest.raises(ValueError, match="ragattn.merge_attention_states: all tensors must be on one device"):
            torch.ops.ragattn.merge_attention_states(*mixed)
    meta = [a.to("meta") for a in args]
    out, lse = torch.ops.ragattn.merge_attention_states(*meta)
    assert out.shape == args[0].shape and lse.shape == args[1].shape
    meta[2] = meta[2][:3]
    with pytest.raises(ValueError, match="ragattn.merge_attention_states: out_b"):
        torch.ops.ragattn.merge_attention_states(*meta)


def test_opcheck(backend, device):
    args = _states(7, 3, 64, torch.float32, device)
    args[1][0] = float("-inf")
    torch.library.opcheck(torch.ops.ragattn.merge_attention_states.default, args)
    torch.library.opcheck(torch.ops.ragattn.merge_attention_states.out, args,
                          dict(out=torch.empty_like(args[0]), lse_out=torch.empty_like(args[1])))


@pytest.mark.parametrize(
    "index,bad,exc,match",
    [
        (0, lambda t: t.long(), TypeError, "out_a"),
        (2, lambda t: t.float(), TypeError, "out_b"),
        (2, lambda t: t[:3], ValueError, "out_b"),
        (1, lambda t: t.half(), TypeError, "lse_a"),
        (3, lambda t: t[:, :1], ValueError, "lse_b"),
    ],
)
def test_bad_inputs(index, bad, exc, match):
    args = list(_states(5, 2, 64, torch.float16, "cpu"))
    args[index] = bad(args[index])
    with pytest.raises(exc, match=f"ragattn.merge_attention_states.*{match}"):
        ragattn.merge_attention_states(*args)


_COMPILE_CHECK = r"""
import triton
import ragattn.triton_kernels.merge_attention_states as mas
from tests.helpers import SM90_CASES, compile_many_sm90

jobs = []
for elt, head_dim in SM90_CASES:
    block_d = triton.next_power_of_2(head_dim)
    jobs.append((mas._merge_two_kernel, dict(BLOCK_H=32, BLOCK_D=block_d),
                 {"out_a": "*" + elt, "out_b": "*" + elt, "out": "*" + elt,
                  "lse_a": "*fp32", "lse_b": "*fp32", "lse": "*fp32"}, {}))
    for block_s in (2, 64):  # paged_attention's split counts: 2 .. 64
        jobs.append((mas._merge_split_kernel, dict(BLOCK_S=block_s, BLOCK_H=32, BLOCK_D=block_d),
                     {"parts_out": "*fp32", "parts_lse": "*fp32", "out": "*" + elt, "lse": "*fp32"}, {}))
    for log2 in (False, True):  # the N-way kernel, both lse bases
        jobs.append((mas._merge_n_kernel, dict(BLOCK_H=32, BLOCK_D=block_d, LOG2=log2),
                     {"outs": "*" + elt, "lses": "*fp32", "out": "*" + elt, "lse": "*fp32"}, {}))
compile_many_sm90(jobs)

# Vector loads and stores. With the integer specialisation a real launch gets (head_dim
# and strides divisible by 16, unit head strides of the lse), each thread moves 16 bytes at a time;
# the old one-(row, head)-per-program kernel masked by a runtime length and moved 2 bytes per load.
import re
from ragattn.bench.sm90 import compile_sm90
ints = dict(num_heads=32, head_dim=128, stride_at=4096, stride_ah=128, stride_bt=4096, stride_bh=128, stride_ot=4096,
            stride_oh=128, stride_lat=32, stride_lah=1, stride_lbt=32, stride_lbh=1, stride_lot=32, stride_loh=1)
for elt in ("bf16", "fp32"):
    ptx = compile_sm90(mas._merge_two_kernel, dict(BLOCK_H=32, BLOCK_D=128),
                       {"out_a": "*" + elt, "out_b": "*" + elt, "out": "*" + elt, "lse_a": "*fp32", "lse_b": "*fp32",
                        "lse": "*fp32"}, ints=ints).asm["ptx"]
    assert re.search(r"ld\.global(\.\w+)*\.v4", ptx) and re.search(r"st\.global(\.\w+)*\.v4", ptx), elt
print("compiled")
"""


def test_one_program_per_row_over_all_heads(monkeypatch):
    """Both merge kernels run one program per row covering every head (was one per
    (row, head), one element per thread): the launch grids recorded, nothing runs."""
    import ragattn.triton_kernels.merge_attention_states as mas

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append((tuple(grid), kw["BLOCK_H"]))

    monkeypatch.setattr(mas, "_merge_two_kernel", Recorder())
    monkeypatch.setattr(mas, "_merge_split_kernel", Recorder())
    oa, ob = randn_nonzero(37, 12, 80), randn_nonzero(37, 12, 80)
    la, lb = randn_nonzero(37, 12), randn_nonzero(37, 12)
    mas.merge_two_states(oa, la, ob, lb)
    mas.merge_split_states(torch.stack([oa, ob]), torch.stack([la, lb]), torch.empty_like(oa), torch.empty_like(la))
    assert launches == [((37,), 16), ((37,), 16)]


def test_kernels_compile_for_sm90():
    """Both merge kernels compile for an H100 (sm_90) in every dtype and head dim, within its
    shared memory; needs no GPU (a subprocess: this process's kernels are interpreter objects)."""
    run_compile_check(_COMPILE_CHECK)


# ---- In-place and N-way forms, base-2 lses (FlashInfer's convention) ----

from ragattn.reference.merge_attention_states import merge_attention_states_n as ref_merge_n  # noqa: E402

LN2 = 0.6931471805599453


def _n_states(s, n, h, d, dtype, device, gen):
    outs = randn_nonzero(s, n, h, d, dtype=dtype, device=device, generator=gen)
    lses = (3 * torch.randn(s, n, h, generator=gen)).to(device)
    lses[0, 0] = float("-inf")                     # one state empty for row 0
    lses[:, 1, :2] = float("-inf")                 # every state empty: out 0, lse -inf
    if s > 1:
        lses[1, 2, 0] = float("inf")               # FlashAttention's empty marker
        outs[1, 2, 0] = float("nan")               # never read
    return outs, lses


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("s", [1, 3, 6])
def test_merge_n_matches_reference(backend, device, dtype, s):
    gen = torch.Generator().manual_seed(40 + s)
    outs, lses = _n_states(s, 29, 5, 64, dtype, device, gen)
    out, lse = ragattn.merge_attention_states_n(outs, lses)
    cpu = (outs.cpu(), lses.cpu())
    out64, lse64 = ref_merge_n(cpu[0].double(), cpu[1].double())
    out_lp, _ = ref_merge_n(*cpu)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == (29, 5, 64)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_precision(out.cpu(), out64, out_lp, what="out")
    torch.testing.assert_close(lse.cpu().double(), lse64, atol=1e-5, rtol=1e-6)
    assert (out[1, :2] == 0).all() and (lse[1, :2] == float("-inf")).all()


def test_merge_n_equals_cascade_of_pairs(backend, device):
    """Merging S states at once equals merging them pairwise (a cascade), and a list input equals the
    stacked one."""
    gen = torch.Generator().manual_seed(50)
    outs, lses = _n_states(4, 17, 3, 64, torch.float32, device, gen)
    out, lse = ragattn.merge_attention_states_n(outs, lses)
    o, l = outs[0], lses[0]
    for i in range(1, 4):
        o, l = ragattn.merge_attention_states(o, l, outs[i], lses[i])
    torch.testing.assert_close(out, o, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(lse, l, atol=2e-6, rtol=2e-6)
    out_l, lse_l = ragattn.merge_attention_states_n(list(outs.unbind(0)), list(lses.unbind(0)))
    assert torch.equal(out_l, out) and torch.equal(lse_l, lse)


def test_merge_n_strided_and_edge_rule(backend, device):
    gen = torch.Generator().manual_seed(51)
    outs, lses = _n_states(3, 9, 4, 64, torch.float16, device, gen)
    lses[2, 5, 1] = float("nan")                   # poisons (5, 1)
    outs[0, 6, 2, 3] = float("inf")                # a read state's inf: NaN, never inf
    outs_v = outs.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)   # row-major storage
    lses_v = lses.permute(2, 0, 1).contiguous().permute(1, 2, 0)          # head-major storage
    out, lse = ragattn.merge_attention_states_n(outs_v, lses_v)
    ro, rl = ref_merge_n(outs.cpu(), lses.cpu())
    torch.testing.assert_close(out.cpu(), ro, equal_nan=True, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.cpu(), rl, equal_nan=True, atol=1e-5, rtol=1e-5)
    assert torch.isnan(out[5, 1]).all() and torch.isnan(lse[5, 1]) and torch.isfinite(out[5, 0]).all()
    assert torch.isnan(out[6, 2, 3]) and torch.isfinite(out[6, 2, :3]).all()
    empty_o, empty_l = ragattn.merge_attention_states_n(outs[:0], lses[:0])
    assert (empty_o == 0).all() and (empty_l == float("-inf")).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merge_inplace_equals_functional(backend, device, seed, dtype):
    out_a, lse_a, out_b, lse_b = _states(23, 6, 64, dtype, device)
    lse_a[0] = float("-inf")
    out_a[0] = float("nan")
    want_o, want_l = ragattn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    a, la = out_a.clone(), lse_a.clone()
    assert ragattn.merge_attention_states_(a, la, out_b, lse_b) is None
    assert torch.equal(a, want_o) and torch.equal(la, want_l)
    # strided accumulators: a head-major out and a transposed [H, N] lse buffer
    a_v = out_a.transpose(0, 1).contiguous().transpose(0, 1)
    la_buf = lse_a.t().contiguous()
    ragattn.merge_attention_states_(a_v, la_buf.t(), out_b, lse_b)
    assert torch.equal(a_v, want_o) and torch.equal(la_buf.t(), want_l)


def test_merge_inplace_refuses_aliasing(device):
    out_a, lse_a, out_b, lse_b = _states(5, 2, 64, torch.float32, device)
    with pytest.raises(ValueError, match="merge_attention_states_: out_a must not share memory with out_b"):
        ragattn.merge_attention_states_(out_a, lse_a, out_a, lse_b)
    with pytest.raises(ValueError, match="merge_attention_states_: lse_a must not share memory with lse_b"):
        ragattn.merge_attention_states_(out_a, lse_a, out_b, lse_a)
    with pytest.raises(TypeError, match="merge_attention_states_: log2 must be a bool"):
        ragattn.merge_attention_states_(out_a, lse_a, out_b, lse_b, log2=1)


def test_log2_lses(backend, device, seed):
    """FlashInfer's base-2 lses: log2=True merges them exactly as the natural-log merge of lse * ln 2,
    and returns base 2; the same lses read as natural log give visibly wrong weights (the test can fail)."""
    out_a, lse_a, out_b, lse_b = _states(19, 4, 64, torch.float32, device)
    lse_a[0] = float("-inf")
    lse_b[1] = float("inf")
    l2a, l2b = lse_a / LN2, lse_b / LN2            # the same states in base 2
    o2, l2 = ragattn.merge_attention_states(out_a, l2a, out_b, l2b, log2=True)
    o, l = ragattn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(o2, o, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(l2 * LN2, l, atol=2e-6, rtol=2e-6)
    ro, rl = ref_merge(*[t.cpu().double() for t in (out_a, l2a, out_b, l2b)], log2=True)
    torch.testing.assert_close(o2.cpu().double(), ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l2.cpu().double(), rl, atol=1e-5, rtol=1e-6)
    wrong, _ = ragattn.merge_attention_states(out_a, l2a, out_b, l2b)
    assert float((wrong - o).abs().max()) > 1e-2
    # in place and N-way take the flag too
    a, la = out_a.clone(), l2a.clone()
    ragattn.merge_attention_states_(a, la, out_b, l2b, log2=True)
    assert torch.equal(a, o2) and torch.equal(la, l2)
    on, ln = ragattn.merge_attention_states_n(torch.stack((out_a, out_b)), torch.stack((l2a, l2b)), log2=True)
    torch.testing.assert_close(on, o2, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(ln, l2, atol=2e-6, rtol=2e-6)


def test_new_forms_opcheck(backend, device):
    args = _states(7, 3, 64, torch.float32, device)
    args[1][0] = float("-inf")
    torch.library.opcheck(torch.ops.ragattn.merge_attention_states.default, args + (True,))
    torch.library.opcheck(torch.ops.ragattn.merge_attention_states_.default, args + (False,))
    torch.library.opcheck(torch.ops.ragattn.merge_attention_states_.default, args + (True,))
    outs, lses = _n_states(3, 7, 3, 64, torch.float32, device, torch.Generator().manual_seed(52))
    torch.library.opcheck(torch.ops.ragattn.merge_attention_states_n.default, (outs, lses, False))
    torch.library.opcheck(torch.ops.ragattn.merge_attention_states_n.default, (outs, lses, True))


def test_new_forms_fake_validate():
    outs = torch.empty(3, 5, 2, 64, device="meta")
    with pytest.raises(ValueError, match=r"merge_attention_states_n: lses must have shape \(3, 5, 2\)"):
        torch.ops.ragattn.merge_attention_states_n(outs, torch.empty(3, 5, 3, device="meta"))
    o, l = torch.ops.ragattn.merge_attention_states_n(outs, torch.empty(3, 5, 2, device="meta"))
    assert o.shape == (5, 2, 64) and l.shape == (5, 2)
    with pytest.raises(ValueError, match="merge_attention_states_: out_a must not share memory with out_b"):
        a = torch.empty(5, 2, 64, device="meta")
        torch.ops.ragattn.merge_attention_states_(a, torch.empty(5, 2, device="meta"), a, torch.empty(5, 2, device="meta"))


def test_new_forms_under_inference_mode_and_compile(device):
    out_a, lse_a, out_b, lse_b = _states(6, 2, 64, torch.float32, device)
    with torch.inference_mode():
        a, la = out_a.clone(), lse_a.clone()
        ragattn.merge_attention_states_(a, la, out_b, lse_b)
        ragattn.merge_attention_states_n(torch.stack((out_a, out_b)), torch.stack((lse_a, lse_b)))

    def step(a, la, b, lb):
        torch.ops.ragattn.merge_attention_states_(a, la, b, lb)
        return torch.ops.ragattn.merge_attention_states_n(torch.stack((a, b)), torch.stack((la, lb)), True)

    a1, la1, a2, la2 = out_a.clone(), lse_a.clone(), out_a.clone(), lse_a.clone()
    want = step(a1, la1, out_b, lse_b)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(a2, la2, out_b, lse_b)
    assert torch.equal(a1, a2) and torch.equal(la1, la2)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


@pytest.mark.parametrize("head_dim, dtype, heads", [(80, torch.bfloat16, 8), (96, torch.float16, 1),
                                                    (256, torch.float32, 4)])
def test_other_head_dims(backend, device, head_dim, dtype, heads):
    """Head dims 80 and 96 (padded, masked tiles) and 256, one to eight heads: the pair
    merge into poisoned outputs, the N-way merge (3 states with empty ones) and, on the Triton path,
    the split-KV merge kernel over float32 partials, against the float64 reference."""
    from ragattn.reference.merge_attention_states import merge_attention_states as ref_pair

    outs, lses = _n_states(3, 11, heads, head_dim, dtype, device, torch.Generator().manual_seed(head_dim))
    cpu = (outs.cpu(), lses.cpu())
    out, lse = poison_like(outs[0]), poison_like(lses[0])
    ragattn.merge_attention_states(outs[0], lses[0], outs[1], lses[1], out=out, lse_out=lse)
    out64, lse64 = ref_pair(cpu[0][0].double(), cpu[1][0].double(), cpu[0][1].double(), cpu[1][1].double())
    out_lp, _ = ref_pair(cpu[0][0], cpu[1][0], cpu[0][1], cpu[1][1])
    assert_precision(out.cpu(), out64, out_lp, what="pair out")
    torch.testing.assert_close(lse.cpu().double(), lse64, atol=1e-5, rtol=1e-6)
    out, lse = ragattn.merge_attention_states_n(outs, lses)
    out64, lse64 = ref_merge_n(cpu[0].double(), cpu[1].double())
    out_lp, _ = ref_merge_n(*cpu)
    assert_precision(out.cpu(), out64, out_lp, what="n-way out")
    torch.testing.assert_close(lse.cpu().double(), lse64, atol=1e-5, rtol=1e-6)
    if backend == "triton":
        from ragattn.triton_kernels.merge_attention_states import merge_split_states

        parts = outs.float()
        parts[1, 2, 0] = 0.0  # a split with lse +inf is "saw no key" to the N-way merge only: give it 0 and -inf
        lses_split = lses.clone()
        lses_split[1, 2, 0] = float("-inf")
        out, lse = poison_like(outs[0]), poison_like(lses[0])
        merge_split_states(parts, lses_split, out, lse)
        out64, lse64 = ref_merge_n(parts.cpu().double(), lses_split.cpu().double())
        out_lp, _ = ref_merge_n(parts.cpu().to(dtype), lses_split.cpu())
        assert_precision(out.cpu(), out64, out_lp, what="split out")
        torch.testing.assert_close(lse.cpu().double(), lse64, atol=1e-5, rtol=1e-6)
