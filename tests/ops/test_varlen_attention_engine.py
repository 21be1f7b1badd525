"""varlen_attention's fake impl, named errors and inference mode; engine-style inputs (int64 indices,
out=); head dims that are not powers of two."""
from __future__ import annotations
import math
import pytest
import torch
import ragattn
from ragattn.reference import varlen_attention as ref_varlen
from tests.helpers import assert_precision, max_abs_err, poison_like, randn_nonzero, triton_device, use_kernel_backend

from tests.ops.test_varlen_attention import _case, _float64, _lens
from tests.ops.test_varlen_attention_plan import _check_gradients


# ----------------------------------------------------------------------------------------------
# Fake impl validates, named errors, inference mode
# ----------------------------------------------------------------------------------------------
def test_meta_tensor_mixed_with_cpu_raises():
    q, k, v, cu_q, cu_k, *_ = _case([5, 6], [5, 7], 4, 2, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="ragattn.varlen_attention: all tensors must be on one device"):
        ragattn.varlen_attention(q.to("meta"), k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match="ragattn.varlen_attention: all tensors must be on one device"):
        ragattn.varlen_attention(q, k, v.to("meta"), cu_q, cu_k)


def test_fake_impl_validates_like_the_real_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, cu_q, cu_k, *_ = _case([5, 6], [5, 7], 4, 2, 64, torch.float32, "cpu")
    with FakeTensorMode() as mode:
        fq, fk, fv, fcq, fck = (mode.from_tensor(t) for t in (q, k, v, cu_q, cu_k))
        out, lse = ragattn.varlen_attention(fq, fk, fv, fcq, fck)
        assert out.shape == q.shape and lse.shape == q.shape[:2]
        with pytest.raises(ValueError, match="v must have shape"):
            ragattn.varlen_attention(fq, fk, fv[:, :, :32], fcq, fck)
        with pytest.raises(TypeError, match="k must be"):
            ragattn.varlen_attention(fq, fk.half(), fv.half(), fcq, fck)
        with pytest.raises(ValueError, match="multiple"):
            ragattn.varlen_attention(fq[:, :3], fk, fv, fcq, fck)
        with pytest.raises(ValueError, match="q_pos"):
            ragattn.varlen_attention(fq, fk, fv, fcq, fck, fcq)


def test_head_dim_zero_is_a_named_error():
    q, k, v, cu_q, cu_k, *_ = _case([5], [5], 2, 1, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="ragattn.varlen_attention: q must have head_dim > 0"):
        ragattn.varlen_attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], cu_q, cu_k)


@pytest.mark.parametrize("backend", ["default", "triton"])
def test_inference_mode(device, backend, monkeypatch):
    """Serving runs under torch.inference_mode(): forward and out= on every backend, with the
    plan cache (which cannot see in-place edits of inference tensors) bypassed."""
    use_kernel_backend(monkeypatch, device, backend)
    with torch.inference_mode():
        args = list(_case([40, 3], [40, 3], 4, 2, 64, torch.float32, device, blocks="chunks", gen=torch.Generator().manual_seed(9)))
        out, lse = ragattn.varlen_attention(*args, None, 5)
        o64, l64 = ref_varlen(*_float64(args), None, 5)
        assert max_abs_err(out, o64) < 1e-4 and max_abs_err(lse, l64) < 1e-4
        args[8].fill_(-1)  # in-place edit of an inference tensor: the next call must see it
        args[7].fill_(-1)
        out2, _ = ragattn.varlen_attention(*args, None, 5)
        assert max_abs_err(out2, ref_varlen(*_float64(args), None, 5)[0]) < 1e-4
        o_buf, l_buf = poison_like(out), poison_like(lse)
        ragattn.varlen_attention(*args, None, 5, out=o_buf, lse_out=l_buf)
        assert torch.equal(o_buf, out2)


# ----------------------------------------------------------------------------------------------
# Engine-style inputs (int64 indices, out= / lse_out=)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["default", "triton"])
def test_int64_indices(device, backend, monkeypatch):
    use_kernel_backend(monkeypatch, device, backend)
    args = _case([30, 0, 17], [30, 2, 17], 4, 2, 64, torch.float32, device, blocks="sys", pos="shuffled",
                 gen=torch.Generator().manual_seed(13))
    args64 = [a.long() if torch.is_tensor(a) and not a.is_floating_point() else a for a in args]
    out32, lse32 = ragattn.varlen_attention(*args, None, 7)
    out64, lse64 = ragattn.varlen_attention(*args64, None, 7)
    assert torch.equal(out32, out64) and torch.equal(lse32, lse64)
    o64, _ = ref_varlen(*_float64(args64), None, 7)
    assert max_abs_err(out64, o64) < 1e-4


def test_int64_positions_outside_int32_refused():
    q, k, v, cu_q, cu_k, *_ = _case([5], [5], 2, 1, 64, torch.float32, "cpu")
    pos = torch.arange(5, dtype=torch.int64) + 2**31
    with pytest.raises(ValueError, match="q_pos values must fit in int32"):
        ragattn.varlen_attention(q, k, v, cu_q, cu_k, pos)


@pytest.mark.parametrize("backend", ["default", "triton"])
def test_out_variant(device, backend, monkeypatch):
    use_kernel_backend(monkeypatch, device, backend)
    args = _case([21, 4], [21, 9], 4, 2, 64, torch.float16, device, blocks="chunks", pos="offset",
                 gen=torch.Generator().manual_seed(14))
    want_o, want_l = ragattn.varlen_attention(*args, None, 6)
    out, lse = poison_like(want_o), poison_like(want_l)
    got_o, got_l = ragattn.varlen_attention(*args, None, 6, out=out, lse_out=lse)
    assert got_o is out and got_l is lse
    assert torch.equal(out, want_o) and torch.equal(lse, want_l)
    torch.library.opcheck(torch.ops.ragattn.varlen_attention.out, tuple(args) + (None, 6),
                          {"out": poison_like(want_o), "lse_out": poison_like(want_l)})


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda q: (torch.empty(q.shape[0] + 1, *q.shape[1:]), None), "out must have shape"),
        (lambda q: (torch.empty_like(q, dtype=torch.float64), None), "out must be float32"),
        (lambda q: (torch.empty(q.shape[0], q.shape[2], q.shape[1]).transpose(1, 2), None), "out must be contiguous"),
        (lambda q: (None, torch.empty(q.shape[0], q.shape[1], dtype=torch.float16)), "lse_out must be float32"),
        (lambda q: (q, None), "out must not share memory with q"),
        (lambda q: (torch.empty_like(q, device="meta"), None), "out must be on cpu"),
    ],
)
def test_out_variant_refuses_bad_buffers(make, words):
    q, k, v, cu_q, cu_k, *_ = _case([5, 6], [5, 7], 4, 2, 64, torch.float32, "cpu")
    out, lse = make(q)
    with pytest.raises(ValueError if "float" not in words else TypeError, match=words):
        ragattn.varlen_attention(q, k, v, cu_q, cu_k, out=out, lse_out=lse)


def test_out_variant_refuses_overlapping_lse_and_out():
    q, k, v, cu_q, cu_k, *_ = _case([5, 6], [5, 7], 4, 2, 64, torch.float32, "cpu")
    buf = torch.empty(q.numel() + 44)
    with pytest.raises(ValueError, match="out must not share memory with lse_out"):
        ragattn.varlen_attention(q, k, v, cu_q, cu_k, out=buf[: q.numel()].view(q.shape), lse_out=buf[q.numel() - 4:][: 44].view(11, 4))


def test_out_variant_under_compile():
    """The out= overload mutates its buffers and returns nothing: torch.compile functionalises it."""
    args = _case([9, 4], [9, 6], 4, 2, 64, torch.float32, "cpu", blocks="chunks", gen=torch.Generator().manual_seed(15))

    def f(o, l, *a):
        torch.ops.ragattn.varlen_attention.out(*a, None, 3, out=o, lse_out=l)
        return o * 2, l

    want = ragattn.varlen_attention(*args, None, 3)
    o, l = poison_like(want[0]), poison_like(want[1])
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(o, l, *args)
    assert torch.equal(got[0], want[0] * 2) and torch.equal(o, want[0]) and torch.equal(l, want[1])


# ----------------------------------------------------------------------------------------------
# Head dims that are not powers of two run in Triton (BLOCK_D padded and masked)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim, dtype", [(80, torch.bfloat16), (96, torch.float32), (112, torch.float16)])
def test_padded_head_dims_run_in_triton(device, monkeypatch, dim, dtype):
    from ragattn.ops.varlen_attention import _use_triton

    use_kernel_backend(monkeypatch, device, "triton")
    args = _case([29, 1, 18], [29, 1, 18], 6, 2, dim, dtype, device, blocks="chunks", gen=torch.Generator().manual_seed(dim))
    assert _use_triton(args[0])
    leaves = [t.detach().requires_grad_(True) for t in args[:3]]
    out, lse = ragattn.varlen_attention(*leaves, *args[3:], None, 9)
    o64, l64 = ref_varlen(*_float64(args), None, 9)
    o_lp, l_lp = ref_varlen(*args, None, 9, upcast=False)
    assert_precision(out, o64, o_lp, what="out")
    assert_precision(lse, l64, l_lp, what="lse")
    dout = randn_nonzero(*out.shape, dtype=dtype, device=device, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, leaves, dout)
    l64s = [t.detach().double().requires_grad_(True) for t in args[:3]]
    want64 = torch.autograd.grad(ref_varlen(*l64s, *args[3:], None, 9)[0], l64s, dout.double())
    llp = [t.detach().requires_grad_(True) for t in args[:3]]
    want_lp = torch.autograd.grad(ref_varlen(*llp, *args[3:], None, 9, upcast=False)[0], llp, dout)
    for name, g, w64, wlp in zip(("dq", "dk", "dv"), got, want64, want_lp):
        assert_precision(g, w64, wlp, what=name)


@pytest.mark.parametrize("backend", ["triton", "default"])
@pytest.mark.parametrize("ratio, dim, dtype, mask, causal, window", [
    (8, 256, torch.bfloat16, "chunks", True, 9),
    (4, 80, torch.float16, "random", False, 20),
])
def test_head_dims_gqa_and_windows_forward_backward(device, seed, backend, monkeypatch, ratio, dim, dtype, mask, causal,
                                                    window):
    """Forward and backward at head dims 256 and 80 without a soft cap (test_soft_cap
    runs them with one), GQA 8 and 4 under a window, blocks; lengths off the tiles, an empty and a
    length-1 sequence; the forward into poisoned out=/lse_out= buffers."""
    use_kernel_backend(monkeypatch, device, backend)
    lens_q, lens_k = _lens("default")
    hkv = 1 if ratio == 8 else 2
    args = _case(lens_q, lens_k, hkv * ratio, hkv, dim, dtype, device, blocks=mask, causal=causal,
                 gen=torch.Generator().manual_seed(seed)) + (None, window)
    out, lse = poison_like(args[0]), poison_like(args[0][..., 0].float())
    ragattn.varlen_attention(*args, out=out, lse_out=lse)
    o64, l64 = ref_varlen(*_float64(args))
    o_lp, l_lp = ref_varlen(*args, upcast=False)
    assert_precision(out, o64, o_lp, what="out")
    assert_precision(lse, l64, l_lp, what="lse")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(l64)) and (out[torch.isneginf(l64)] == 0).all()
    _check_gradients(args, randn_nonzero(*out.shape, dtype=dtype, device=device,
                                          generator=torch.Generator().manual_seed(seed + 1)))


def test_more_work_items_than_a_cuda_grid_axis_holds(monkeypatch):
    """CUDA's grid axes y and z stop at 65535 programs, and a long packed batch has
    more work items than that (1M query rows are 16K-64K tiles). Every launch keeps axes 1 and 2
    within the limit (recorded with a plan that claims 70,000 items per side; nothing runs)."""
    import dataclasses

    import ragattn.triton_kernels.varlen_attention as va

    grids = []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(tuple(grid))
            return lambda *a, **kw: None

    for name in ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"):
        monkeypatch.setattr(va, name, Recorder())
    real = va._cached_plan
    plan_csr = []

    def many_items(*a, **kw):
        plan = real(*a, **kw)
        plan_csr.append(plan.by_q)
        many = lambda csr: csr if csr is None else dataclasses.replace(csr, work=csr.work.new_zeros(70_000, 8))  # noqa: E731
        return dataclasses.replace(plan, by_q=many(plan.by_q), by_k=many(plan.by_k))

    monkeypatch.setattr(va, "_cached_plan", many_items)
    args = _case([40, 3], [40, 3], 4, 2, 64, torch.float32, triton_device(), blocks="chunks")
    out, lse = va.varlen_attention_fwd(*args[:9], True, None)
    va.varlen_attention_bwd(torch.ones_like(out), *args[:3], out, lse, *args[3:9], True, None)
    assert len(grids) == 3, grids
    for grid, heads in zip(grids, (4, 4, 2)):   # forward, dq (query heads), dk/dv (kv heads)
        assert grid[0] == heads and all(g <= 65535 for g in grid[1:]) and math.prod(grid[1:]) >= 70_000, grid
    # the padding items (the grid's last row past 70,000) are empty: no rows, written in place
    grid, work = va._launch(4, dataclasses.replace(plan_csr[0], work=plan_csr[0].work.new_ones(70_000, 8)))
    assert grid == (4, 65535, 2) and work.shape == (2 * 65535, 8)
    assert (work[70_000:, :6] == 0).all() and (work[70_000:, 6] == -1).all() and (work[:70_000] == 1).all()
