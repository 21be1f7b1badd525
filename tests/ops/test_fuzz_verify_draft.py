"""Property test of ``verify_draft``: random batch sizes (0 included), chain lengths (0 and 1
included), vocabularies (up to two vocabulary slices of the CUDA kernel), logits dtypes, temperatures, eta,
padded / flat (vLLM) layouts, with and
without draft probabilities, and non-finite logits (+inf, -inf, NaN) injected, on the fast C++ default,
the C++ twin and the reference path, token for token against the float64 reference (uniforms kept away from the
rounding thresholds, see test_verify_draft.robust_uniforms)."""
from __future__ import annotations

import pytest
import torch

import ragattn
from ragattn.reference import speculative as ref
from tests.ops.test_verify_draft import assert_same, check_structure, make_case, robust_uniforms
from tests.ops.test_verify_draft_engine import _flatten

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import assume, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SPECIAL = [float("inf"), float("-inf"), float("nan")]


@st.composite
def cases(draw):
    bsz = draw(st.integers(0, 5))
    g = draw(st.integers(0, 4))
    vocab = draw(st.sampled_from([1, 2, 7, 40, 333, 4101]))  # 4101: two vocabulary slices of the kernel
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    temperature = draw(st.sampled_from([1.0, 0.6, 1e-3]))
    eta = draw(st.sampled_from([0.0, 4.0]))
    alpha = draw(st.sampled_from([0.0, 0.1, 1.0]))
    layout = draw(st.sampled_from(["padded", "num_draft", "flat"]))
    with_probs = draw(st.booleans())
    special = draw(st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIAL)), max_size=6))
    backend = draw(st.sampled_from(["default", "reference", "twin"]))
    seed = draw(st.integers(0, 2**16))
    return bsz, g, vocab, dtype, temperature, eta, alpha, layout, with_probs, special, backend, seed


@given(cases())
def test_verify_draft_property(case):
    with pytest.MonkeyPatch.context() as mp:
        if case[-2] in ("reference", "twin"):
            mp.setenv("RAGATTN_CPU_BACKEND", case[-2])
        else:
            mp.delenv("RAGATTN_CPU_BACKEND", raising=False)
        _check(case)


def _check(case):
    bsz, g, vocab, dtype, temperature, eta, alpha, layout, with_probs, special, backend, seed = case
    gen = torch.Generator().manual_seed(seed)
    x, q, z, u = make_case(bsz, g, vocab, dtype=dtype, temperature=temperature, gen=gen)
    flat = z.view(-1)
    for i, val in special:
        if flat.numel():
            flat[i % flat.numel()] = val
    if not with_probs:
        q = torch.nn.functional.one_hot(x, vocab).float()
    nd = torch.randint(0, g + 1, (bsz,), generator=gen) if layout != "padded" else None
    try:
        u = robust_uniforms(x, q, z, u, temperature, eta, alpha, nd, gen)
    except AssertionError:
        assume(False)  # every draw sits within rounding of a threshold (tiny vocabularies)
    want = ref.verify_draft(x, q, z, u, temperature, eta, alpha, False, nd)
    q_run = q if with_probs else None
    kw = dict(temperature=temperature, eta=eta, alpha=alpha)
    if layout == "flat":
        cu, xf, qf, zf, uf, rows = _flatten(x, q_run, z, u, nd)
        out, n = ragattn.verify_draft(xf, qf, zf, uf, cu_num_draft=cu, **kw)
        assert torch.equal(n, want[1]) and torch.equal(out, want[0][rows])
        return
    got = ragattn.verify_draft(x, q_run, z, u, num_draft=nd, **kw)
    assert_same(got, want, f"{layout} {backend}")
    check_structure(*got, x, nd)
    assert ((got[0] >= -1) & (got[0] < vocab)).all()
