"""Property test of ``merge_attention_states``: random shapes, lse values mixing finite, -inf,
+inf (FlashAttention's empty-row marker), NaN and far-apart magnitudes, outs with NaN/inf, every
CPU backend (default, reference, Triton interpreter; where CUDA is up, the compiled Triton kernel
on CUDA tensors instead) against the float64 reference's rule."""
from __future__ import annotations

import pytest
import torch

import ragattn
from ragattn.reference.merge_attention_states import merge_attention_states as ref_merge
from tests.helpers import triton_backend_device

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


LSE_VALUES = [0.0, 1.5, -3.0, 90.0, -120.0, float("-inf"), float("inf"), float("nan")]


@st.composite
def merge_cases(draw):
    n = draw(st.integers(0, 9))
    h = draw(st.integers(1, 5))
    d = draw(st.sampled_from([1, 8, 24, 64]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    special = draw(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 63), st.sampled_from(LSE_VALUES)), max_size=8))
    bad_out = draw(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 10**6),
                                      st.sampled_from([float("nan"), float("inf"), float("-inf")])), max_size=4))
    seed = draw(st.integers(0, 2**16))
    return n, h, d, dtype, special, bad_out, seed


@given(merge_cases())
def test_merge_attention_states_property(case):
    n, h, d, dtype, special, bad_out, seed = case
    gen = torch.Generator().manual_seed(seed)
    outs = [torch.randn(n, h, d, generator=gen).to(dtype) for _ in range(2)]
    lses = [3 * torch.randn(n, h, generator=gen) for _ in range(2)]
    if n:
        for side, at, value in special:
            lses[side].view(-1)[at % (n * h)] = value
        for side, at, value in bad_out:
            outs[side].view(-1)[at % (n * h * d)] = value
    args = (outs[0], lses[0], outs[1], lses[1])
    want, want_lse = ref_merge(*[t.double() for t in args])
    for backend in ("default", "reference", "triton"):
        dev = torch.device("cpu") if backend != "triton" else triton_backend_device()
        if dev is None:
            continue   # compiled Triton kernels and no usable GPU (RAGATTN_TEST_FAKE_CUDA)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RAGATTN_CPU_BACKEND", backend)
            out, lse = ragattn.merge_attention_states(*[t.to(dev) for t in args])
            out, lse = out.cpu(), lse.cpu()
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert torch.equal(torch.isnan(out), torch.isnan(want)), backend
        assert torch.equal(torch.isnan(lse), torch.isnan(want_lse)), backend
        assert not torch.isinf(out).any() and not (lse == float("inf")).any()
        assert torch.equal(lse == float("-inf"), want_lse == float("-inf")), backend
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol, equal_nan=True)
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5, equal_nan=True)

