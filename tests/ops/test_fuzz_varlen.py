"""Property-based tests (hypothesis) of varlen_attention and key_attention_scores (
"Keep it that way"): every backend that runs here against the float64 reference, on drawn
shapes, GQA ratios, lengths (0 and 1 included), positions up to 2^31 - 1, blocks, windows and
NaN/inf-poisoned inputs that the output must not see.

Profiles (registered in tests/conftest.py): ``ci`` (default; derandomised, 40 examples per test
and backend: the Triton interpreter pays per program) and ``thorough``
(``HYPOTHESIS_PROFILE=thorough``: random, ``HYPOTHESIS_MAX_EXAMPLES`` examples, longer sequences).
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

# The interpreter warns on the NaN/inf the poisoned cases feed it on purpose.

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ragattn  # noqa: E402
from ragattn.reference import key_attention_scores as ref_scores  # noqa: E402
from ragattn.reference import varlen_attention as ref_varlen  # noqa: E402
from ragattn.reference.varlen_attention import visible_mask  # noqa: E402

# Profiles (tests/conftest.py): ``ci`` (default, derandomised) and ``thorough``
# (HYPOTHESIS_PROFILE=thorough, HYPOTHESIS_MAX_EXAMPLES examples per test, larger shapes here).
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE", "ci") == "thorough"


def _examples(ci: int) -> settings:
    """``ci`` examples in the ci profile (the interpreter pays per program); the profile's own
    count in the thorough one."""
    return settings() if THOROUGH else settings(max_examples=ci)


MAX_LEN = 80 if THOROUGH else 40
INT32_MAX = 2**31 - 1
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@contextlib.contextmanager
def _backend(name: str):
    """RAGATTN_CPU_BACKEND for the block (monkeypatch is function-scoped: hypothesis refuses it)."""
    old = os.environ.get("RAGATTN_CPU_BACKEND")
    os.environ["RAGATTN_CPU_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("RAGATTN_CPU_BACKEND", None)
        else:
            os.environ["RAGATTN_CPU_BACKEND"] = old


BACKENDS = ["reference", "triton"] if torch.cuda.is_available() is False else ["reference"]


def _check(got: torch.Tensor, ref64: torch.Tensor, ref_lp: torch.Tensor, what: str):
    """Non-finite exactly where the float64 reference is; finite entries within 2x the
    low-precision reference's error plus a dtype floor (the tests' precision rule)."""
    bad64 = ~torch.isfinite(ref64)
    assert torch.equal(~torch.isfinite(got), bad64), f"{what}: non-finite pattern differs from the reference"
    ok = ~bad64
    if not ok.any():
        return
    err = (got.double() - ref64)[ok].abs().max().item()
    base = (ref_lp.double() - ref64)[ok & torch.isfinite(ref_lp)].abs().max().item() if (ok & torch.isfinite(ref_lp)).any() else 0.0
    scale = max(1.0, ref64[ok].abs().max().item())
    assert err <= 2 * base + FLOOR[got.dtype if got.dtype in FLOOR else torch.float32] * scale, (what, err, base)


# ----------------------------------------------------------------------------------------------
# varlen_attention
# ----------------------------------------------------------------------------------------------
@st.composite
def varlen_problems(draw):
    batch = draw(st.integers(1, 3))
    lens_q = [draw(st.sampled_from([0, 1, draw(st.integers(0, MAX_LEN))])) for _ in range(batch)]
    same = draw(st.booleans())
    lens_k = lens_q if same else [draw(st.sampled_from([0, 1, draw(st.integers(0, MAX_LEN))])) for _ in range(batch)]
    hkv = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([16, 24, 64]))  # 24: padded to 32 and masked
    dtype = draw(st.sampled_from(DTYPES))
    causal = draw(st.booleans())
    window = draw(st.sampled_from([-1, -1, 0, 1, draw(st.integers(0, MAX_LEN)), INT32_MAX]))
    pos_mode = draw(st.sampled_from(["default", "base", "random"]))
    base = draw(st.sampled_from([0, 1000, INT32_MAX - 2 * MAX_LEN])) if pos_mode != "default" else 0
    blocks = draw(st.sampled_from(["none", "random", "chunks"]))
    poison = draw(st.sampled_from(["none", "v_nan", "v_inf", "k_nan"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(lens_q=lens_q, lens_k=lens_k, hkv=hkv, group=group, head_dim=head_dim, dtype=dtype, causal=causal,
                window=window, pos_mode=pos_mode, base=base, blocks=blocks, poison=poison, seed=seed)


def _varlen_inputs(p):
    g = torch.Generator().manual_seed(p["seed"])
    tq, tk = sum(p["lens_q"]), sum(p["lens_k"])
    H, Hkv, D = p["hkv"] * p["group"], p["hkv"], p["head_dim"]

    def data(n, h):
        x = torch.randn(n, h, D, generator=g)
        return torch.where(x.abs() < 1e-3, torch.full_like(x, 1e-3), x).to(p["dtype"])

    q, k, v = data(tq, H), data(tk, Hkv), data(tk, Hkv)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    cu_q, cu_k = cu(p["lens_q"]), cu(p["lens_k"])
    q_pos = kv_pos = None
    if p["pos_mode"] == "base":  # bottom-right aligned, shifted by base (up to 2^31 - 1)
        q_pos = torch.cat([torch.arange(max(lk - lq, 0), max(lk - lq, 0) + lq) for lq, lk in zip(p["lens_q"], p["lens_k"])] + [torch.zeros(0)])
        kv_pos = torch.cat([torch.arange(lk) for lk in p["lens_k"]] + [torch.zeros(0)])
        q_pos, kv_pos = (t.long() + p["base"] for t in (q_pos, kv_pos))
    elif p["pos_mode"] == "random":
        span = 2 * MAX_LEN
        q_pos = torch.randint(0, span, (tq,), generator=g) + p["base"]
        kv_pos = torch.randint(0, span, (tk,), generator=g) + p["base"]
    if q_pos is not None:
        q_pos, kv_pos = q_pos.to(torch.int32), kv_pos.to(torch.int32)
    q_blk = kv_blk = None
    if p["blocks"] == "random":
        q_blk = torch.randint(-1, 3, (tq,), generator=g, dtype=torch.int32)
        kv_blk = torch.randint(-1, 3, (tk,), generator=g, dtype=torch.int32)
    elif p["blocks"] == "chunks":  # chunks of 7, the last 5 tokens of each sequence global
        def chunks(lens):
            out = []
            for n in lens:
                out += [-1 if i >= n - 5 else i // 7 for i in range(n)]
            return torch.tensor(out, dtype=torch.int32)
        q_blk, kv_blk = chunks(p["lens_q"]), chunks(p["lens_k"])
    return q, k, v, cu_q, cu_k, q_pos, kv_pos, q_blk, kv_blk


def _poison_invisible(p, q, k, v, cu_q, cu_k, q_pos, kv_pos, q_blk, kv_blk, g):
    """Poison a few keys (NaN or inf in V, NaN in K). Returns the poisoned (k, v)."""
    if p["poison"] == "none" or k.shape[0] == 0:
        return k, v
    k, v = k.clone(), v.clone()
    n = max(1, k.shape[0] // 8)
    idx = torch.randperm(k.shape[0], generator=g)[:n]
    col = torch.randint(0, k.shape[2], (n,), generator=g)
    head = torch.randint(0, k.shape[1], (n,), generator=g)
    if p["poison"] == "k_nan":
        k[idx, head, col] = float("nan")
    else:
        v[idx, head, col] = float("nan") if p["poison"] == "v_nan" else float("inf")
    return k, v


@pytest.mark.parametrize("backend", BACKENDS)
@_examples(40)
@given(p=varlen_problems())
def test_varlen_attention_fuzz(backend, p):
    q, k, v, cu_q, cu_k, q_pos, kv_pos, q_blk, kv_blk = _varlen_inputs(p)
    k, v = _poison_invisible(p, q, k, v, cu_q, cu_k, q_pos, kv_pos, q_blk, kv_blk, torch.Generator().manual_seed(p["seed"] + 1))
    rest = (cu_q, cu_k, q_pos, kv_pos, q_blk, kv_blk, p["causal"], None, p["window"])
    with _backend(backend):
        out, lse = ragattn.varlen_attention(q, k, v, *rest)
    o64, l64 = ref_varlen(q.double(), k.double(), v.double(), *rest)
    o_lp, l_lp = ref_varlen(q, k, v, *rest, upcast=False)
    _check(out, o64, o_lp, "out")
    _check(lse, l64, l_lp, "lse")
    # rows that see no key: out 0, lse -inf (never NaN)
    dead = torch.isneginf(l64)
    assert torch.equal(torch.isneginf(lse), dead) and (out[dead] == 0).all()
    # no poisoned value of a key that a row cannot see reaches it: compare with the clean inputs
    if p["poison"] != "none":
        kc, vc = (torch.nan_to_num(t, nan=0.5, posinf=0.5) for t in (k, v))
        oc, _ = ref_varlen(q.double(), kc.double(), vc.double(), *rest)
        blind = torch.ones(q.shape[0], dtype=torch.bool)
        cq, ck = cu_q.tolist(), cu_k.tolist()
        qp = q_pos if q_pos is not None else torch.cat([torch.arange(cq[b + 1] - cq[b]) for b in range(len(cq) - 1)]).int()
        kp = kv_pos if kv_pos is not None else torch.cat([torch.arange(ck[b + 1] - ck[b]) for b in range(len(ck) - 1)]).int()
        qb = q_blk if q_blk is not None else torch.full((q.shape[0],), -1, dtype=torch.int32)
        kb = kv_blk if kv_blk is not None else torch.full((k.shape[0],), -1, dtype=torch.int32)
        bad_key = ~(torch.isfinite(k).all(dim=(1, 2)) & torch.isfinite(v).all(dim=(1, 2)))
        for b in range(len(cq) - 1):
            vis = visible_mask(qp[cq[b]:cq[b + 1]], kp[ck[b]:ck[b + 1]], qb[cq[b]:cq[b + 1]], kb[ck[b]:ck[b + 1]],
                               p["causal"], p["window"])
            blind[cq[b]:cq[b + 1]] = ~(vis & bad_key[ck[b]:ck[b + 1]][None, :]).any(1)
        assert torch.isfinite(out[blind]).all() and not (torch.isnan(lse[blind]) | torch.isposinf(lse[blind])).any()
        assert (out[blind].double() - oc[blind]).abs().max().item() <= 0.05 if blind.any() else True


# ----------------------------------------------------------------------------------------------
# key_attention_scores
# ----------------------------------------------------------------------------------------------
@st.composite
def kas_problems(draw):
    batch = draw(st.integers(1, 3))
    lens_q = [draw(st.sampled_from([0, 1, draw(st.integers(0, 12))])) for _ in range(batch)]
    lens_k = [draw(st.sampled_from([0, 1, draw(st.integers(0, MAX_LEN * 2))])) for _ in range(batch)]
    return dict(
        lens_q=lens_q, lens_k=lens_k, hkv=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2, 4])),
        head_dim=draw(st.sampled_from([16, 40, 64])), dtype=draw(st.sampled_from(DTYPES)),
        poison=draw(st.sampled_from(["none", "k_nan", "q_nan", "k_inf"])),
        scale=draw(st.sampled_from([None, 0.05, 0.3])), seed=draw(st.integers(0, 2**31 - 1)),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@_examples(40)
@given(p=kas_problems())
def test_key_attention_scores_fuzz(backend, p):
    g = torch.Generator().manual_seed(p["seed"])
    tq, tk = sum(p["lens_q"]), sum(p["lens_k"])
    H, Hkv, D = p["hkv"] * p["group"], p["hkv"], p["head_dim"]
    # q and k are views into NaN-filled buffers: the heads around them must never be read
    q_buf = torch.full((tq, H + 2, D), float("nan"), dtype=p["dtype"])
    k_buf = torch.full((tk, Hkv + 1, D), float("nan"), dtype=p["dtype"])
    q, k = q_buf[:, 1:H + 1], k_buf[:, :Hkv]
    q.copy_(torch.randn(tq, H, D, generator=g))
    k.copy_(2 * torch.randn(tk, Hkv, D, generator=g))
    if p["poison"] != "none":
        t = q if p["poison"] == "q_nan" else k
        if t.shape[0]:
            row = int(torch.randint(0, t.shape[0], (1,), generator=g))
            t[row, 0, 0] = float("inf") if p["poison"] == "k_inf" else float("nan")
            if p["poison"] == "k_inf":  # keep q . k = +inf (a -inf logit is a plain zero-mass key)
                q.abs_()
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int64)  # noqa: E731
    cu_q, cu_k = cu(p["lens_q"]), cu(p["lens_k"])
    with _backend(backend):
        got = ragattn.key_attention_scores(q, k, cu_q, cu_k, p["scale"])
    ref64 = ref_scores(q.double(), k.double(), cu_q, cu_k, p["scale"])
    ref_lp = ref_scores(q, k, cu_q, cu_k, p["scale"], compute_dtype=q.dtype)
    assert got.dtype == torch.float32 and got.shape == (tk,)
    _check(got, ref64, ref_lp, "scores")
