"""ragattn.varlen_attention vs the float64 reference (default path and the Triton kernels).

The Triton kernels run on CPU tensors under TRITON_INTERPRET=1 through RAGATTN_CPU_BACKEND=triton;
interpreter cost ~ programs x loop trips, so the shapes are short and the grid is sampled.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

import ragattn
from ragattn.reference import varlen_attention as ref_varlen
from tests.helpers import assert_precision, max_abs_err, poison_like, randn_nonzero

OP = torch.ops.ragattn.varlen_attention


def _case(lens_q, lens_k, H, Hkv, D, dtype, device, *, blocks="none", causal=True, pos="default", gen=None):
    """Random packed inputs. blocks: none | chunks (global tail) | many | one | qglobal | kvglobal | sys."""
    g = gen or torch.Generator().manual_seed(0)
    tq, tk = sum(lens_q), sum(lens_k)
    q = randn_nonzero(tq, H, D, dtype=dtype, device=device, generator=g)
    k = randn_nonzero(tk, Hkv, D, dtype=dtype, device=device, generator=g)
    v = randn_nonzero(tk, Hkv, D, dtype=dtype, device=device, generator=g)
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0).tolist()), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0).tolist()), dtype=torch.int32, device=device)

    def blk(lens, side):
        out = []
        for n in lens:
            if blocks == "none":
                b = [-1] * n
            elif blocks == "one":
                b = [3] * n
            elif blocks == "many":
                b = [i // 3 for i in range(n)]  # blocks of 3 tokens, much smaller than a tile
            elif blocks == "random":
                b = torch.randint(-1, 3, (n,), generator=g).tolist()
            else:  # chunks of 7 tokens, a global system prompt of 5 and a global tail of 6
                b = [-1 if (i < 5 and blocks == "sys") else (i // 7) for i in range(n)]
                tail = n - 6
                b = [(-1 if i >= tail else x) for i, x in enumerate(b)]
                if blocks == "qglobal" and side == "k":
                    b = [max(x, 0) for x in b]
                if blocks == "kvglobal" and side == "q":
                    b = [max(x, 0) for x in b]
            out += b
        return torch.tensor(out, dtype=torch.int32, device=device)

    q_block = None if blocks == "none" else blk(lens_q, "q")
    kv_block = None if blocks == "none" else blk(lens_k, "k")
    q_pos = kv_pos = None
    if pos == "offset":  # bottom-right aligned queries (a suffix of the keys)
        q_pos = torch.cat([torch.arange(lk - lq, lk) for lq, lk in zip(lens_q, lens_k)]).to(torch.int32).to(device)
    elif pos == "shuffled":  # arbitrary positions (duplicates allowed)
        q_pos = torch.randint(0, max(lens_k + [1]), (tq,), generator=g, dtype=torch.int32).to(device)
        kv_pos = torch.randint(0, max(lens_k + [1]), (tk,), generator=g, dtype=torch.int32).to(device)
    return q, k, v, cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, causal


def _dense_check(out, lse, args):
    """Independent dense check in float64 (softmax over a masked matrix) for a few rows."""
    q, k, v, cu_q, cu_k, q_pos, kv_pos, q_block, kv_block, causal = args
    o64, l64 = ref_varlen(*[a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args])
    return o64, l64


def test_basic_causal_matches_sdpa(device):
    """One sequence, default positions/blocks: plain causal attention (compared with SDPA)."""
    g = torch.Generator().manual_seed(1)
    q = randn_nonzero(37, 4, 64, dtype=torch.float64, device=device, generator=g)
    k = randn_nonzero(37, 2, 64, dtype=torch.float64, device=device, generator=g)
    v = randn_nonzero(37, 2, 64, dtype=torch.float64, device=device, generator=g)
    cu = torch.tensor([0, 37], dtype=torch.int32, device=device)
    out, lse = ragattn.varlen_attention(q, k, v, cu, cu)
    kk, vv = (t.repeat_interleave(2, 1).transpose(0, 1) for t in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True).transpose(0, 1)
    assert max_abs_err(out, want) < 1e-10
    s = (q.transpose(0, 1) @ kk.transpose(1, 2)) / 8.0
    s = s.masked_fill(torch.ones(37, 37, dtype=torch.bool, device=device).triu(1), float("-inf"))
    assert max_abs_err(lse, torch.logsumexp(s, -1).transpose(0, 1).float()) < 1e-5


def test_no_visible_key_rows(device):
    """Rows that see no key: out 0, lse -inf, no NaN, also in the gradient."""
    q, k, v, cu_q, cu_k, *_ = _case([4, 5], [3, 0], 2, 1, 64, torch.float32, device)
    q_pos = torch.tensor([0, 5, 1, 2, 0, 1, 2, 3, 4], dtype=torch.int32, device=device)
    kv_pos = torch.tensor([1, 2, 3], dtype=torch.int32, device=device)
    q.requires_grad_(True)
    out, lse = ragattn.varlen_attention(q, k, v, cu_q, cu_k, q_pos, kv_pos)
    assert torch.isneginf(lse[0]).all() and (out[0] == 0).all()  # position 0 < every key position
    assert torch.isfinite(lse[1]).all()
    assert torch.isneginf(lse[4:]).all() and (out[4:] == 0).all()  # sequence without keys
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("backend", ["default", "triton"])
def test_opcheck(device, backend, monkeypatch):
    if backend == "triton":
        if device.type == "cpu":
            monkeypatch.setenv("RAGATTN_CPU_BACKEND", "triton")
    args = _case([9, 0, 12], [9, 4, 12], 4, 2, 64, torch.float32, device, blocks="sys")
    q, k, v = (t.requires_grad_(True) for t in args[:3])
    torch.library.opcheck(OP, (q, k, v) + tuple(args[3:]), {"scale": 0.1})


@pytest.mark.parametrize(
    "mutate, exc, words",
    [
        (lambda a: a.update(q=a["q"].long()), TypeError, "q must be"),
        (lambda a: a.update(k=a["k"].half()), TypeError, "k must be"),
        (lambda a: a.update(v=a["v"][:, :, :32]), ValueError, "v must have shape"),
        (lambda a: a.update(k=a["k"][:, :, :32], v=a["v"][:, :, :32]), ValueError, "k must have shape"),
        (lambda a: a.update(q=torch.cat([a["q"]] * 3, 1)[:, :3]), ValueError, "multiple"),
        (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), TypeError, "cu_seqlens_q"),
        (lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"][:-1]), ValueError, "cu_seqlens_k"),
        (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].flip(0)), ValueError, "cu_seqlens_q"),
        (lambda a: a.update(q_pos=torch.zeros(3, dtype=torch.int32)), ValueError, "q_pos"),
        (lambda a: a.update(kv_block=torch.zeros(a["k"].shape[0])), TypeError, "kv_block"),
        (lambda a: a.update(scale=float("nan")), ValueError, "scale"),
    ],
)
def test_bad_inputs(mutate, exc, words):
    q, k, v, cu_q, cu_k, *_ = _case([5, 6], [5, 7], 4, 2, 64, torch.float32, "cpu")
    a = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    mutate(a)
    with pytest.raises(exc, match=words) as info:
        ragattn.varlen_attention(**a)
    assert "ragattn.varlen_attention" in str(info.value)
