"""Property test of ``paged_attention``: random shapes, GQA ratios, page sizes, lengths (0 and 1
included), positions up to 2^31 - 1, windows, int32/int64 metadata and NaN/inf-poisoned slots,
every CPU backend (default, reference, Triton interpreter unsplit and split-KV; where CUDA is up,
the compiled Triton kernels on CUDA tensors instead of the interpreter) against the float64
reference. ``HYPOTHESIS_PROFILE=thorough`` for a long manual run (tests/conftest.py)."""
from __future__ import annotations

import math

import pytest
import torch

import ragattn
from ragattn.reference.paged_attention import paged_attention as ref_paged
from ragattn.reference.paged_attention import visible_slots
from tests.helpers import FACTOR, max_abs_err, triton_backend_device

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


BIG = 2**31 - 1


@st.composite
def paged_cases(draw):
    num_kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    head_dim = draw(st.sampled_from([8, 24, 64]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    page_size = draw(st.sampled_from([1, 3, 8, 16]))
    batch = draw(st.integers(1, 3))
    kv_lens = draw(st.lists(st.sampled_from([0, 1, 2, 7, 16, 17, 40, 70]), min_size=batch, max_size=batch))
    positions = []
    for n in kv_lens:
        pos = st.one_of(st.integers(0, n + 3), st.sampled_from([BIG, BIG - 1]))
        positions.append(draw(st.lists(pos, min_size=0, max_size=4)))
    window_left = draw(st.sampled_from([-1, -1, 0, 1, 5, 30, BIG]))
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    poison = draw(st.sampled_from(["unseen", "unseen+visible_v", "unseen+visible_k"]))
    seed = draw(st.integers(0, 2**16))
    return dict(num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype, page_size=page_size,
                kv_lens=kv_lens, positions=positions, window_left=window_left, index_dtype=index_dtype,
                poison=poison, seed=seed)


def build(c):
    gen = torch.Generator().manual_seed(c["seed"])
    ps, hkv, d = c["page_size"], c["num_kv_heads"], c["head_dim"]
    pages = [max(1, math.ceil(n / ps)) for n in c["kv_lens"]]
    num_pages = sum(pages) + 2
    perm = torch.randperm(num_pages, generator=gen)
    bt = torch.full((len(pages), max(pages)), -1, dtype=torch.int64)
    at = 0
    for b, n in enumerate(pages):
        bt[b, :n] = perm[at: at + n]
        at += n
    k = torch.randn(num_pages, ps, hkv, d, generator=gen)
    v = torch.randn(num_pages, ps, hkv, d, generator=gen)
    # poison every (page, offset) that no row sees: unused pages, stale slots past kv_lens, slots
    # right of every row's position and left of every row's window
    seen = torch.zeros(num_pages, ps, dtype=torch.bool)
    for b, (n, rows) in enumerate(zip(c["kv_lens"], c["positions"])):
        if rows and n:
            vis = visible_slots(torch.tensor(rows), n, c["window_left"]).any(0)
            for j in vis.nonzero().flatten().tolist():
                seen[bt[b, j // ps], j % ps] = True
    k[~seen] = float("nan")
    v[~seen] = float("inf")
    if c["poison"] != "unseen" and seen.any():
        # one visible slot of some row (maybe masked for others): the rule decides who gets NaN
        idx = seen.nonzero()[torch.randint(0, int(seen.sum()), (1,), generator=gen)][0]
        target = v if c["poison"] == "unseen+visible_v" else k
        target[idx[0], idx[1], 0, torch.randint(0, d, (1,), generator=gen)] = float("nan")
    q_pos = [p for rows in c["positions"] for p in rows]
    cu = [0]
    for rows in c["positions"]:
        cu.append(cu[-1] + len(rows))
    it = c["index_dtype"]
    q = torch.randn(len(q_pos), hkv * c["group"], d, generator=gen)
    dt = c["dtype"]
    return (q.to(dt), torch.tensor(q_pos, dtype=it), torch.tensor(cu, dtype=it), k.to(dt), v.to(dt), bt.to(it),
            torch.tensor(c["kv_lens"], dtype=it))


def check(args, out, lse, window_left):
    out64, lse64 = ref_paged(*[a.double() if a.is_floating_point() else a for a in args], None, window_left)
    out_lp, _ = ref_paged(*args, None, window_left, compute_dtype=args[0].dtype)
    assert torch.equal(torch.isnan(out), torch.isnan(out64)), "NaN pattern of out"
    assert torch.equal(torch.isnan(lse), torch.isnan(lse64)), "NaN pattern of lse"
    assert torch.equal(lse == float("-inf"), lse64 == float("-inf")), "rows that see no key"
    assert not torch.isinf(out).any() and not (lse == float("inf")).any()
    assert (out[lse64 == float("-inf")] == 0).all()
    ok = ~torch.isnan(out64) & ~torch.isnan(out_lp)
    zero = torch.zeros((), dtype=torch.float64)
    err = max_abs_err(torch.where(ok, out.double(), zero), torch.where(ok, out64, zero))
    base = max_abs_err(torch.where(ok, out_lp.double(), zero), torch.where(ok, out64, zero))
    floor = 4 * torch.finfo(args[0].dtype).eps * 4  # |out| <= max |v| ~ 4 for normal data
    assert err <= FACTOR * base + floor, (err, base)
    fin = torch.isfinite(lse64)
    assert max_abs_err(lse[fin].double(), lse64[fin]) <= 1e-2 * (1 if args[0].dtype != torch.float32 else 0.01) + 1e-5


@given(paged_cases())
def test_paged_attention_property(c):
    args = build(c)
    w = c["window_left"]
    for backend, splits in [("default", None), ("reference", None), ("triton", "1"), ("triton", "3")]:
        dev = torch.device("cpu") if backend != "triton" else triton_backend_device()
        if dev is None:
            continue   # compiled Triton kernels and no usable GPU (RAGATTN_TEST_FAKE_CUDA)
        on = [a.to(dev) for a in args]
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RAGATTN_CPU_BACKEND", backend)
            if splits:
                mp.setenv("RAGATTN_PAGED_NUM_SPLITS", splits)
            out, lse = ragattn.paged_attention(*on, None, w)
            out, lse = out.cpu(), lse.cpu()
            check(args, out, lse, w)
            out2 = torch.full_like(on[0], float("nan"))
            ragattn.paged_attention(*on, None, w, out=out2)
            out2 = out2.cpu()
            assert torch.equal(torch.isnan(out2), torch.isnan(out)) and torch.equal(out2.nan_to_num(), out.nan_to_num())



@settings(max_examples=min(12, settings.default.max_examples))   # the interpreter: slow per example
@given(paged_cases(), st.integers(0, 2**16))
def test_plan_then_rewrite_in_place_then_run_property(c, seed):
    """plan_paged_attention over stale contents (another split of the query rows, another page
    table and other kv_lens, maxima covering both), the real ones copied into the same tensors in
    place, then run_paged_attention on every backend: the float64 reference of the real inputs
    (docs/ops.md: a plan captures shapes and tile counts, never contents)."""
    q, q_pos, cu, k, v, bt, kv_lens = args = build(c)
    w = c["window_left"]
    gen = torch.Generator().manual_seed(seed)
    total, batch = q.shape[0], cu.shape[0] - 1
    cuts = torch.randint(0, total + 1, (batch - 1,), generator=gen).sort().values.tolist()
    stale_cu = torch.tensor([0] + cuts + [total], dtype=cu.dtype)
    rows = (cu[1:] - cu[:-1]).tolist() + (stale_cu[1:] - stale_cu[:-1]).tolist()
    max_kv = max(1, bt.shape[1] * c["page_size"])
    for backend, splits in [("default", None), ("reference", None), ("triton", "1"), ("triton", "3")]:
        dev = torch.device("cpu") if backend != "triton" else triton_backend_device()
        if dev is None:
            continue
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RAGATTN_CPU_BACKEND", backend)
            if splits:
                mp.setenv("RAGATTN_PAGED_NUM_SPLITS", splits)
            cu_t = stale_cu.to(dev)
            table = ragattn.PageTable.from_block_table(bt[torch.randperm(batch, generator=gen)].to(dev),
                                                       torch.randint(0, max_kv + 1, (batch,), generator=gen).to(dev))
            plan = ragattn.plan_paged_attention(cu_t, table, num_heads=q.shape[1], num_kv_heads=k.shape[2],
                                                head_dim=q.shape[2], dtype=q.dtype, window_left=w,
                                                max_q_len=max(1, max(rows)), max_kv_len=max_kv)
            cu_t.copy_(cu)
            table.pages.copy_(bt)
            table.kv_lens.copy_(kv_lens)
            out, lse = ragattn.run_paged_attention(plan, q.to(dev), q_pos.to(dev), k.to(dev), v.to(dev))
            check(args, out.cpu(), lse.cpu(), w)
