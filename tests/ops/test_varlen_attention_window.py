"""varlen_attention under a sliding window (window_left) against the float64 reference and transformers' mask."""
from __future__ import annotations
import pytest
import torch
import ragattn
from ragattn.reference import varlen_attention as ref_varlen
from tests.helpers import assert_precision, max_abs_err, randn_nonzero, require_triton_on, use_kernel_backend

from tests.ops.test_varlen_attention import _case, _float64, _lens


# ----------------------------------------------------------------------------------------------
# Sliding window (window_left): FlashAttention's window_size=(window_left, -1)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["triton", "default"])
@pytest.mark.parametrize(
    "mask, causal, window, ratio, dtype, pos",
    [
        ("none", True, 5, 4, torch.bfloat16, "default"),
        ("chunks", True, 9, 3, torch.float16, "offset"),
        ("sys", True, 40, 1, torch.float32, "default"),
        ("none", False, 6, 8, torch.float16, "shuffled"),
        ("random", True, 3, 4, torch.float32, "shuffled"),
    ],
)
def test_sliding_window_matches_reference(device, seed, backend, monkeypatch, mask, causal, window, ratio, dtype, pos):
    use_kernel_backend(monkeypatch, device, backend)
    lens_q, lens_k = _lens(pos)
    hkv = 1 if ratio == 8 else 2
    args = _case(lens_q, lens_k, hkv * ratio, hkv, 64, dtype, device, blocks=mask, causal=causal, pos=pos,
                 gen=torch.Generator().manual_seed(seed))
    out, lse = ragattn.varlen_attention(*args, None, window)
    o64, l64 = ref_varlen(*_float64(args), None, window)
    o_lp, l_lp = ref_varlen(*args, None, window, upcast=False)
    assert_precision(out, o64, o_lp, what="out")
    assert_precision(lse, l64, l_lp, what="lse")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(l64))
    # the window changes the answer (the test would pass without it otherwise)
    assert max_abs_err(o64, ref_varlen(*_float64(args))[0]) > 1e-3


@pytest.mark.parametrize("mask, causal, window", [("many", True, 7), ("sys", False, 12), ("random", True, 0)])
def test_sliding_window_small_tiles(device, mask, causal, window):
    """16-row tiles: whole key tiles left of the window are skipped (forward, dq) and whole query
    tiles right of it (dk/dv); gradients against the float64 reference's autograd."""
    from ragattn.triton_kernels.varlen_attention import varlen_attention_bwd, varlen_attention_fwd

    require_triton_on(device)
    lens = [40, 0, 21] if mask == "random" else [70, 0, 33]  # shuffled positions: every tile pair partial
    args = _case(lens, [lens[0], 2, lens[2]], 4, 2, 64, torch.float32, device, blocks=mask, causal=causal,
                 pos="shuffled" if mask == "random" else "default", gen=torch.Generator().manual_seed(11))
    out, lse = varlen_attention_fwd(*args, None, window, block_m=16, block_n=16)
    o64, l64 = ref_varlen(*_float64(args), None, window)
    o32, l32 = ref_varlen(*args, None, window)
    assert_precision(out, o64, o32, what="out")
    assert_precision(lse, l64, l32, what="lse")
    dout = randn_nonzero(*out.shape, device=device, generator=torch.Generator().manual_seed(12))
    got = varlen_attention_bwd(dout, *args[:3], out, lse, *args[3:], None, window, block_m=16, block_n=16)
    leaves = [t.double().requires_grad_(True) for t in args[:3]]
    want = torch.autograd.grad(ref_varlen(*leaves, *args[3:], None, window)[0], leaves, dout.double())
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert max_abs_err(g, w) < 1e-4 * max(1.0, float(w.abs().max())), name


def test_sliding_window_is_transformers_sliding_window():
    """window_left = sliding_window - 1 gives exactly transformers' sliding-window causal mask."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    from ragattn.reference.varlen_attention import visible_mask

    n = 23
    pos = torch.arange(n, dtype=torch.int32)
    blk = torch.full((n,), -1, dtype=torch.int32)
    for sliding_window in (1, 2, 5, 30):
        fn = masking_utils.sliding_window_causal_mask_function(sliding_window)
        idx = torch.arange(n)
        want = fn(torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :]).expand(n, n)
        got = visible_mask(pos, pos, blk, blk, True, sliding_window - 1)
        assert torch.equal(got, want), sliding_window


def test_sliding_window_matches_sdpa(device):
    """One sequence, float64: the window equals SDPA with the explicit band mask."""
    g = torch.Generator().manual_seed(2)
    q = randn_nonzero(29, 2, 64, dtype=torch.float64, device=device, generator=g)
    k = randn_nonzero(29, 2, 64, dtype=torch.float64, device=device, generator=g)
    v = randn_nonzero(29, 2, 64, dtype=torch.float64, device=device, generator=g)
    cu = torch.tensor([0, 29], dtype=torch.int32, device=device)
    i = torch.arange(29, device=device)
    band = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - 4)
    out, _ = ragattn.varlen_attention(q, k, v, cu, cu, window_left=4)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=band).transpose(0, 1)
    assert max_abs_err(out, want) < 1e-10


def test_window_left_validated():
    q, k, v, cu_q, cu_k, *_ = _case([5], [5], 2, 1, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="ragattn.varlen_attention: window_left"):
        ragattn.varlen_attention(q, k, v, cu_q, cu_k, window_left=-2)
