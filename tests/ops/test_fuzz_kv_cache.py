"""Property tests of ``rerotate_keys_`` and ``copy_kv_``: random layer counts, GQA head counts, head
dims, partial rotary, NeoX/GPT-J pairs, engine layouts (contiguous, paged, vLLM's ``kv_cache[0]``,
FlashInfer's ``cache[:, 0]``), int32/int64 rows (0 and 1 of them included), deltas over the whole
int32 range, NaN-poisoned rows that must be neither read nor written, on the C++ twin and the
reference path, against the float64 reference."""
from __future__ import annotations

import pytest
import torch

import ragattn
from ragattn.reference import kv_cache as ref
from tests.helpers import assert_precision

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

LAYOUTS = ["contiguous", "paged", "vllm", "flashinfer"]


def _layers(layout, L, rows, H, D, dtype, gen):
    """L layers of >= `rows` rows in `layout`; returns (K views, V views, the owning tensors)."""
    page = 4
    pages = -(-rows // page)
    if layout == "contiguous":
        own = [torch.randn(rows, H, D, generator=gen).to(dtype) for _ in range(2 * L)]
        return own[:L], own[L:], own
    if layout == "paged":
        own = [torch.randn(pages, page, H, D, generator=gen).to(dtype) for _ in range(2 * L)]
        return own[:L], own[L:], own
    if layout == "vllm":
        own = [torch.randn(2, pages, page, H, D, generator=gen).to(dtype) for _ in range(L)]
        return [c[0] for c in own], [c[1] for c in own], own
    own = [torch.randn(pages, 2, page, H, D, generator=gen).to(dtype) for _ in range(L)]
    return [c[:, 0] for c in own], [c[:, 1] for c in own], own


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@st.composite
def cases(draw):
    L = draw(st.integers(1, 3))
    H = draw(st.integers(1, 3))
    D = draw(st.sampled_from([2, 6, 32, 64]))
    rotary_dim = 2 * draw(st.integers(1, D // 2))
    interleaved = draw(st.booleans())
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    src_layout = draw(st.sampled_from(LAYOUTS))
    dst_layout = draw(st.sampled_from(LAYOUTS))
    n_src = draw(st.integers(1, 40))
    n_dst = draw(st.integers(1, 40))
    n = draw(st.integers(0, n_dst))
    big = draw(st.booleans())
    row_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    backend = draw(st.sampled_from(["default", "reference"]))
    seed = draw(st.integers(0, 2**16))
    return L, H, D, rotary_dim, interleaved, dtype, src_layout, dst_layout, n_src, n_dst, n, big, row_dtype, backend, seed


@given(cases(), st.booleans())
def test_copy_kv_and_rerotate_property(case, rotate):
    with pytest.MonkeyPatch.context() as mp:
        if case[-2] == "reference":
            mp.setenv("RAGATTN_CPU_BACKEND", "reference")
        else:
            mp.delenv("RAGATTN_CPU_BACKEND", raising=False)
        _check(case, rotate)


def _check(case, rotate):
    (L, H, D, rd, il, dtype, src_layout, dst_layout, n_src, n_dst, n, big, row_dtype, backend, seed) = case
    gen = torch.Generator().manual_seed(seed)
    sk, sv, _ = _layers(src_layout, L, n_src, H, D, dtype, gen)
    dk, dv, _ = _layers(dst_layout, L, n_dst, H, D, dtype, gen)
    g_src, g_dst = ref.row_layout(sk[0]), ref.row_layout(dk[0])
    src_rows = torch.randint(0, g_src.num_rows, (n,), generator=gen).to(row_dtype)
    dst_rows = torch.randperm(g_dst.num_rows, generator=gen)[:n].to(row_dtype)
    lim = 2**31 - 1 if big else 4096
    delta = torch.randint(-lim, lim, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    f = 1.0 / (10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    # poison every source row that is not read: it must never reach a destination
    unread = torch.ones(g_src.num_rows, dtype=torch.bool)
    unread[src_rows.long()] = False
    all_src = torch.arange(g_src.num_rows)
    for t in sk + sv:
        ref.scatter_rows_(t, all_src[unread], torch.full((int(unread.sum()), H, D), float("nan")))
    before_k, before_v = [t.clone() for t in dk], [t.clone() for t in dv]
    src_k0 = [t.clone() for t in sk]
    ragattn.copy_kv_(dk, dv, sk, sv, src_rows, dst_rows, delta if rotate else None, f if rotate else None,
                     rd if rotate else 0, il)
    written = torch.zeros(g_dst.num_rows, dtype=torch.bool)
    written[dst_rows.long()] = True
    all_dst = torch.arange(g_dst.num_rows)
    for out, b, s in zip(dk + dv, before_k + before_v, sk + sv):
        assert torch.equal(_bits(ref.gather_rows(out, all_dst[~written])), _bits(ref.gather_rows(b, all_dst[~written])))
    for out, s in zip(dv, sv):
        assert torch.equal(ref.gather_rows(out, dst_rows), ref.gather_rows(s, src_rows))  # V bit-exact
    for out, s in zip(dk, src_k0):
        got, x = ref.gather_rows(out, dst_rows), ref.gather_rows(s, src_rows)
        if rotate:
            r64 = ref.rope_rotate(x.double(), delta, f, rd, il)
            low = ref.rope_rotate(x, delta, f, rd, il, compute_dtype=None)
            assert_precision(got, r64, low, what="copied keys")
        else:
            assert torch.equal(got, x)
    # rerotate_keys_ the destination rows back by -delta, in place
    if not rotate or n == 0:
        return
    now = [t.clone() for t in dk]
    ragattn.rerotate_keys_(dk, dst_rows, -delta, f, rd, il)
    for out, b in zip(dk, now):
        x = ref.gather_rows(b, dst_rows)
        r64 = ref.rope_rotate(x.double(), -delta, f, rd, il)
        low = ref.rope_rotate(x, -delta, f, rd, il, compute_dtype=None)
        assert_precision(ref.gather_rows(out, dst_rows), r64, low, what="re-rotated keys")
        assert torch.equal(_bits(ref.gather_rows(out, all_dst[~written])), _bits(ref.gather_rows(b, all_dst[~written])))
