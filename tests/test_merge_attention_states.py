"""merge_attention_states vs the float64 reference and vs attention over the union of key sets."""
from __future__ import annotations

import pytest
import torch

import ragattn
from ragattn.reference.merge_attention_states import merge_attention_states as ref_merge
from tests.helpers import assert_precision, randn_nonzero, run_compile_check, use_kernel_backend

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
    """Issue 14.4: a meta tensor among CPU tensors raises instead of returning garbage."""
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
compile_many_sm90(jobs)

# issue 15.8: vector loads and stores. With the integer specialisation a real launch gets (head_dim
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
    """Issue 15.8: both merge kernels run one program per row covering every head (was one per
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
