"""ragattn.key_attention_scores against the float64 reference (design.md op 6)."""
from __future__ import annotations

import pytest
import torch

import ragattn
from ragattn.reference import key_attention_scores as ref_scores
from tests.helpers import assert_precision, poison_like, randn_nonzero

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def make_inputs(q_lens, k_lens, num_heads, num_kv_heads, head_dim, dtype, device):
    """Packed q/k with cu_seqlens; data scaled so the softmax is far from uniform."""
    cu_q = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(k_lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
    q = randn_nonzero(sum(q_lens), num_heads, head_dim, dtype=dtype, device=device)
    k = (2.0 * randn_nonzero(sum(k_lens), num_kv_heads, head_dim, dtype=torch.float32, device=device)).to(dtype)
    return q, k, cu_q, cu_k


def check_against_reference(q, k, cu_q, cu_k, scale=None):
    out = ragattn.key_attention_scores(q, k, cu_q, cu_k, scale)
    assert out.dtype == torch.float32 and out.shape == (k.shape[0],)
    ref64 = ref_scores(q.double(), k.double(), cu_q, cu_k, scale)
    ref_lowp = ref_scores(q, k, cu_q, cu_k, scale, compute_dtype=q.dtype)
    assert_precision(out, ref64, ref_lowp, what="scores")
    return out


def _use_triton(monkeypatch, backend):
    if backend == "triton":
        monkeypatch.setenv("RAGATTN_CPU_BACKEND", "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("RAGATTN_CPU_BACKEND", raising=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_path_matches_reference(device, seed, dtype):
    q, k, cu_q, cu_k = make_inputs([5, 1, 9], [37, 2, 70], 8, 2, 64, dtype, device)
    check_against_reference(q, k, cu_q, cu_k)


def test_sum_property_and_empty_sequences(device, seed):
    """Scores of a sequence sum to num_q_rows * num_heads; no queries -> 0; no keys -> nothing."""
    q_lens, k_lens = [3, 0, 4, 2], [10, 6, 0, 33]
    q, k, cu_q, cu_k = make_inputs(q_lens, k_lens, 6, 2, 64, torch.float32, device)
    out = check_against_reference(q, k, cu_q, cu_k)
    for b in range(len(q_lens)):
        seg = out[int(cu_k[b]):int(cu_k[b + 1])].double()
        if k_lens[b]:
            torch.testing.assert_close(seg.sum().item(), float(q_lens[b] * 6), rtol=1e-5, atol=1e-5)
    assert (out[int(cu_k[1]):int(cu_k[2])] == 0).all()


def test_opcheck(device, seed):
    q, k, cu_q, cu_k = make_inputs([4, 3], [11, 5], 4, 2, 64, torch.float32, device)
    torch.library.opcheck(torch.ops.ragattn.key_attention_scores.default, (q, k, cu_q, cu_k, None))
    torch.library.opcheck(torch.ops.ragattn.key_attention_scores.default, (q, k, cu_q, cu_k, 0.3))


def _bad(device):
    q, k, cu_q, cu_k = make_inputs([2, 3], [4, 5], 4, 2, 64, torch.float32, device)
    return q, k, cu_q, cu_k


def _i32(*vals):
    return lambda t: torch.tensor(vals, dtype=torch.int32, device=t.device)


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda q, k, cq, ck: (q.double(), k.double(), cq, ck), TypeError, "q must be float16"),
        (lambda q, k, cq, ck: (q, k.half(), cq, ck), TypeError, "k must have q's dtype"),
        (lambda q, k, cq, ck: (q[:, 0], k, cq, ck), ValueError, "q must have 3 dims"),
        (lambda q, k, cq, ck: (q, k[:, :, :32], cq, ck), ValueError, "k must have head_dim 64"),
        (lambda q, k, cq, ck: (q[:, :3], k, cq, ck), ValueError, "num_kv_heads must divide"),
        (lambda q, k, cq, ck: (q, k, cq.long(), ck), TypeError, "cu_seqlens_q must be int32"),
        (lambda q, k, cq, ck: (q, k, cq, _i32(0, 4, 8)(ck)), ValueError, "cu_seqlens_k must start at 0 and end at 9"),
        (lambda q, k, cq, ck: (q, k, cq, _i32(0, 10, 9)(ck)), ValueError, "cu_seqlens_k must be non-decreasing"),
        (lambda q, k, cq, ck: (q, k, _i32(0, 5)(cq), ck), ValueError, "same batch"),
    ],
)
def test_bad_inputs(device, mutate, exc, match):
    args = mutate(*_bad(device))
    with pytest.raises(exc, match=r"ragattn\.key_attention_scores: .*" + match):
        ragattn.key_attention_scores(*args)


def test_bad_scale(device):
    q, k, cu_q, cu_k = _bad(device)
    with pytest.raises(ValueError, match="ragattn.key_attention_scores: scale must be finite"):
        ragattn.key_attention_scores(q, k, cu_q, cu_k, float("nan"))
