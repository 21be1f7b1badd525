"""The output-buffer rules, over every op that writes into a caller's buffer (``out=`` /
``lse_out=``, and the in-place merge's accumulator), on every CPU backend and the interpreter:

    buffer                          rule
    ------------------------------  ---------------------------------------------------------
    expanded (a stride-0 view)      ValueError "overlaps itself" (a kernel would write each
                                    element several times and read its own writes back)
    overlapping an input            ValueError "must not share memory"
    strided, non-overlapping        the functional op's values, bit for bit (or a ValueError
                                    naming the layout where the op documents one, e.g. a
                                    contiguous ``out`` for varlen_attention)
    empty (no row)                  nothing to do: no error, whatever the strides
"""
from __future__ import annotations

import pytest
import torch

import ragattn
from tests.helpers import poison_like, randn_nonzero, use_kernel_backend

I32 = torch.int32
H, HKV, D = 4, 2, 16


def _paged(rows, device, dtype):
    """q [rows, H, D] at positions near the end of one 37-slot sequence, over 5-slot pages."""
    page, ctx = 5, 37
    npages = -(-ctx // page)
    bt = torch.randperm(npages + 2)[:npages].to(I32).view(1, npages).to(device)
    k = randn_nonzero(npages + 2, page, HKV, D, dtype=dtype, device=device)
    v = randn_nonzero(npages + 2, page, HKV, D, dtype=dtype, device=device)
    q = randn_nonzero(rows, H, D, dtype=dtype, device=device)
    q_pos = torch.arange(ctx - rows, ctx, dtype=I32, device=device)
    cu = torch.tensor([0, rows], dtype=I32, device=device)
    kvl = torch.tensor([ctx], dtype=I32, device=device)
    return q, q_pos, cu, k, v, bt, kvl


def paged_attention(rows, device, dtype):
    q, q_pos, cu, k, v, bt, kvl = _paged(rows, device, dtype)
    return (lambda **o: ragattn.paged_attention(q, q_pos, cu, k, v, bt, kvl, **o)), q


def run_paged_attention(rows, device, dtype):
    q, q_pos, cu, k, v, bt, kvl = _paged(rows, device, dtype)
    # from maxima: a plan that reads nothing, so that fake tensors (torch.compile) can make it too
    plan = ragattn.plan_paged_attention(cu, ragattn.PageTable.from_block_table(bt, kvl), num_heads=H,
                                        num_kv_heads=HKV, head_dim=D, dtype=dtype, max_q_len=max(rows, 1),
                                        max_kv_len=37)
    return (lambda **o: ragattn.run_paged_attention(plan, q, q_pos, k, v, **o)), q


def varlen_attention(rows, device, dtype):
    q = randn_nonzero(rows, H, D, dtype=dtype, device=device)
    k, v = (randn_nonzero(rows, HKV, D, dtype=dtype, device=device) for _ in range(2))
    cu = torch.tensor([0, rows], dtype=I32, device=device)
    return (lambda **o: ragattn.varlen_attention(q, k, v, cu, cu, **o)), q


def merge_attention_states(rows, device, dtype):
    a, b = (randn_nonzero(rows, H, D, dtype=dtype, device=device) for _ in range(2))
    la, lb = (randn_nonzero(rows, H, device=device) for _ in range(2))
    return (lambda **o: ragattn.merge_attention_states(a, la, b, lb, **o)), a


def merge_attention_states_(rows, device, dtype):
    """The in-place merge: its accumulator (out_a, lse_a) is the output buffer (the ``out=`` of
    ``call``, filled with state a first)."""
    a, b = (randn_nonzero(rows, H, D, dtype=dtype, device=device) for _ in range(2))
    la, lb = (randn_nonzero(rows, H, device=device) for _ in range(2))

    def call(out=None, lse_out=None):
        if out is None:
            return ragattn.merge_attention_states(a, la, b, lb)
        if 0 not in out.stride() + lse_out.stride():
            out.copy_(a)   # (an expanded accumulator cannot be filled: the op must refuse it as it is)
            lse_out.copy_(la)
        ragattn.merge_attention_states_(out, lse_out, b, lb)
        return out, lse_out
    return call, b   # the input an accumulator must not share memory with is the other state


OPS = [paged_attention, run_paged_attention, varlen_attention, merge_attention_states, merge_attention_states_]
CONTIGUOUS_OUT = {varlen_attention}   # documented: out contiguous like q


@pytest.fixture(params=["default", "triton", "reference"])
def backend(request, monkeypatch, device):
    use_kernel_backend(monkeypatch, device, request.param)
    return request.param


def _buffers(q, how):
    """(out, lse_out) of q's shape, laid out ``how``."""
    t, h, d = q.shape
    if how == "expanded out":
        return torch.empty(1, h, d, dtype=q.dtype, device=q.device).expand(t, h, d), torch.empty(t, h, device=q.device)
    if how == "expanded lse_out":
        return torch.empty_like(q), torch.empty(1, h, device=q.device).expand(t, h)
    if how == "strided":   # every other element of a wider buffer, lse transposed
        return (torch.empty(t, h, 2 * d, dtype=q.dtype, device=q.device)[..., ::2],
                torch.empty(h, t, device=q.device).t())
    raise AssertionError(how)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("how", ["expanded out", "expanded lse_out"])
def test_expanded_output_is_refused(op, how, backend, device):
    call, q = op(7, device, torch.float32)
    out, lse = _buffers(q, how)
    refusal = "overlaps itself|must be contiguous" if op in CONTIGUOUS_OUT and how == "expanded out" else "overlaps itself"
    with pytest.raises(ValueError, match=refusal):
        call(out=out, lse_out=lse)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_output_sharing_an_input_is_refused(op, backend, device):
    call, q = op(7, device, torch.float32)   # q: an input of q's shape
    with pytest.raises(ValueError, match="must not share memory"):
        call(out=q, lse_out=torch.empty(q.shape[:2], device=device))


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_output_gets_the_functional_values(op, dtype, backend, device):
    call, q = op(7, device, dtype)
    want_o, want_l = call()
    out, lse = _buffers(q, "strided")
    out.copy_(poison_like(out))
    lse.copy_(poison_like(lse))
    if op in CONTIGUOUS_OUT:
        with pytest.raises(ValueError, match="contiguous"):
            call(out=out, lse_out=lse)
        return
    got_o, got_l = call(out=out, lse_out=lse)
    assert got_o.data_ptr() == out.data_ptr() and got_l.data_ptr() == lse.data_ptr()
    assert torch.equal(out, want_o) and torch.equal(lse, want_l)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_empty_output_is_nothing_to_do(op, backend, device):
    call, q = op(0, device, torch.float32)
    out, lse = _buffers(q, "strided")
    if op in CONTIGUOUS_OUT:
        out = torch.empty_like(q)
    got_o, got_l = call(out=out, lse_out=lse)
    assert got_o.shape == q.shape and got_l.shape == q.shape[:2]


@pytest.mark.parametrize("op", [merge_attention_states, varlen_attention, paged_attention], ids=lambda f: f.__name__)
def test_fake_impl_refuses_an_expanded_output_too(op):
    """The fake impls (torch.compile's tracing) run the same checks, on strides alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        call, q = op(7, torch.device("cpu"), torch.float32)
        out, lse = _buffers(q, "expanded lse_out")
        with pytest.raises(ValueError, match="overlaps itself"):
            call(out=out, lse_out=lse)


def _overlapping(shape, dtype, device):
    """A buffer of ``shape`` whose last two dims share memory (no stride 0: strides that meet)."""
    *lead, h, d = shape if len(shape) == 3 else (*shape, 1)
    base = torch.empty(max(1, lead[0]) * d + h + d, dtype=dtype, device=device)
    if len(shape) == 3:
        return base.as_strided(shape, (d, 1, 1))
    return base.as_strided(shape, (1, 1))


# the sweep: every rule of the table above over every op, each buffer alone or both at once
SWEEP = {
    "overlapping out": ("overlaps itself", lambda q: (_overlapping(q.shape, q.dtype, q.device),
                                                      torch.empty(q.shape[:2], device=q.device))),
    "overlapping lse_out": ("overlaps itself", lambda q: (torch.empty_like(q),
                                                          _overlapping(q.shape[:2], torch.float32, q.device))),
    "lse_out inside out": ("share memory", lambda q: (lambda o: (o, o.view(-1)[: q.shape[0] * q.shape[1]]
                                                                 .view(q.shape[:2])))(torch.empty_like(q))),
    "expanded, empty": (None, lambda q: (torch.empty(1, *q.shape[1:], dtype=q.dtype, device=q.device)
                                         .expand(q.shape), torch.empty(1, q.shape[1], device=q.device)
                                         .expand(q.shape[:2]))),
}


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("rule", SWEEP)
def test_output_rule_sweep(op, rule, backend, device):
    """Self-overlap without a stride 0, an lse_out inside out, and an expanded buffer of no row
    (nothing to write: accepted, as any empty buffer)."""
    refusal, buffers = SWEEP[rule]
    call, q = op(0 if refusal is None else 7, device, torch.float32)
    out, lse = buffers(q)
    if op in CONTIGUOUS_OUT and rule == "overlapping out":
        refusal = "overlaps itself|must be contiguous"
    if refusal is None:
        got_o, got_l = call(out=out, lse_out=lse)
        assert got_o.shape == q.shape and got_l.shape == q.shape[:2]
        return
    with pytest.raises(ValueError, match=refusal):
        call(out=out, lse_out=lse)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("how", ["expanded out", "expanded lse_out", "overlapping out"])
def test_every_fake_impl_refuses_an_overlapping_output(op, how):
    """The fake impls (torch.compile's tracing) of every op with out= run the same checks, on
    strides alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        call, q = op(7, torch.device("cpu"), torch.float32)
        if how == "overlapping out":
            out, lse = SWEEP[how][1](q)
        else:
            out, lse = _buffers(q, how)
        with pytest.raises(ValueError, match="overlaps itself|must be contiguous"):
            call(out=out, lse_out=lse)
