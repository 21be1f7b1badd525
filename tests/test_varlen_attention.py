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
from tests.helpers import assert_precision, max_abs_err, poison_like, randn_nonzero, run_compile_check, use_kernel_backend

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


def _float64(args):
    return [a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]


MASKS = ["none", "chunks", "sys", "many", "one", "qglobal", "kvglobal", "random"]
GQA = [1, 3, 4, 8]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _grid():
    """Every (mask, causal) pair once, cycling GQA ratio, head dim, dtype and position mode."""
    out = []
    for i, (mask, causal) in enumerate((m, c) for m in MASKS for c in (True, False)):
        ratio = GQA[i % 4]
        dim = (64, 128)[(i // 2) % 2]
        dtype = DTYPES[i % 3]
        pos = ("default", "offset", "shuffled")[(i // 3) % 3]
        out.append(pytest.param(mask, causal, ratio, dim, dtype, pos, id=f"{mask}-{'causal' if causal else 'full'}-g{ratio}-d{dim}-{str(dtype)[6:]}-{pos}"))
    return out


def _lens(pos):
    # awkward lengths, an empty and a length-1 sequence; "offset" has fewer queries than keys
    lens_k = [37, 0, 45, 1]
    lens_q = [13, 0, 45, 1] if pos == "offset" else lens_k
    return lens_q, lens_k


@pytest.mark.parametrize("backend", ["triton", "default"])
@pytest.mark.parametrize("mask, causal, ratio, dim, dtype, pos", _grid())
def test_forward_matches_reference(device, seed, backend, monkeypatch, mask, causal, ratio, dim, dtype, pos):
    if backend == "default" and device.type == "cpu" and (mask, causal) not in {("chunks", True), ("random", False), ("many", True)}:
        pytest.skip("default CPU path is the reference itself: a few cases suffice")
    use_kernel_backend(monkeypatch, device, backend)
    lens_q, lens_k = _lens(pos)
    hkv = 1 if ratio == 8 else 2
    args = _case(lens_q, lens_k, hkv * ratio, hkv, dim, dtype, device, blocks=mask, causal=causal, pos=pos,
                 gen=torch.Generator().manual_seed(seed))
    out, lse = ragattn.varlen_attention(*args)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == args[0].shape
    o64, l64 = ref_varlen(*_float64(args))
    o_lp, l_lp = ref_varlen(*args, upcast=False)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_precision(out, o64, o_lp, what="out")
    assert_precision(lse, l64, l_lp, what="lse")
    dead = torch.isneginf(l64)
    assert torch.equal(torch.isneginf(lse), dead)
    assert (out[dead] == 0).all()


@pytest.mark.parametrize(
    "mask, causal, ratio, dim, dtype, pos",
    [
        ("chunks", True, 4, 64, torch.bfloat16, "default"),
        ("sys", False, 1, 128, torch.float16, "offset"),
        ("many", True, 3, 64, torch.float32, "shuffled"),
        ("random", False, 8, 64, torch.bfloat16, "default"),
        ("kvglobal", True, 1, 64, torch.float16, "default"),
    ],
)
@pytest.mark.parametrize("backend", ["triton", "default"])
def test_gradients_match_reference(device, backend, monkeypatch, mask, causal, ratio, dim, dtype, pos):
    if backend == "default" and device.type == "cpu" and mask != "chunks":
        pytest.skip("default CPU path is the reference's autograd: one case suffices")
    use_kernel_backend(monkeypatch, device, backend)
    lens_q, lens_k = _lens(pos)
    hkv = 1 if ratio == 8 else 2
    args = _case(lens_q, lens_k, hkv * ratio, hkv, dim, dtype, device, blocks=mask, causal=causal, pos=pos,
                 gen=torch.Generator().manual_seed(7))
    dout = randn_nonzero(*args[0].shape, dtype=dtype, device=device, generator=torch.Generator().manual_seed(8))

    def grads(fn, tensors, rest, d):
        leaves = [t.detach().requires_grad_(True) for t in tensors]
        out = fn(*leaves, *rest)[0]
        return torch.autograd.grad(out, leaves, d)

    got = grads(ragattn.varlen_attention, args[:3], args[3:], dout)
    want64 = grads(ref_varlen, _float64(args[:3]), args[3:], dout.double())
    want_lp = grads(lambda *a: ref_varlen(*a, upcast=False), args[:3], args[3:], dout)
    for name, g, w64, wlp in zip(("dq", "dk", "dv"), got, want64, want_lp):
        assert g.dtype == dtype
        assert_precision(g, w64, wlp, what=name)


@pytest.mark.parametrize("mask, causal", [("many", True), ("sys", True), ("chunks", False), ("random", True)])
def test_kernel_small_tiles(device, mask, causal):
    """The launchers with 16-row tiles: many tiles per sequence, so skipping and the mask-free
    fully-visible path are exercised (forward and backward)."""
    from ragattn.triton_kernels.varlen_attention import varlen_attention_bwd, varlen_attention_fwd

    args = _case([50, 0, 33], [50, 2, 33], 4, 2, 64, torch.float32, device, blocks=mask, causal=causal,
                 pos="shuffled" if mask == "random" else "default", gen=torch.Generator().manual_seed(3))
    out, lse = varlen_attention_fwd(*args, None, block_m=16, block_n=16)
    o64, l64 = ref_varlen(*_float64(args))
    o32, l32 = ref_varlen(*args)
    assert_precision(out, o64, o32, what="out")
    assert_precision(lse, l64, l32, what="lse")
    dout = randn_nonzero(*out.shape, device=device, generator=torch.Generator().manual_seed(4))
    got = varlen_attention_bwd(dout, *args[:3], out, lse, *args[3:], None, block_m=16, block_n=16)
    leaves = [t.double().requires_grad_(True) for t in args[:3]]
    want = torch.autograd.grad(ref_varlen(*leaves, *args[3:])[0], leaves, dout.double())
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert max_abs_err(g, w) < 1e-4 * max(1.0, float(w.abs().max())), name


def test_tile_metadata_skips(device):
    """Metadata of independent chunks: the tile pairs of different chunks cannot meet."""
    from ragattn.triton_kernels.varlen_attention import tile_metadata

    cu = torch.tensor([0, 64], dtype=torch.int32, device=device)
    pos = torch.arange(64, dtype=torch.int32, device=device)
    blk = (pos // 16).int()
    blk[48:] = -1
    off, seq, start, meta, search = tile_metadata(cu, pos, blk, 64, 16)
    assert off.tolist() == [0, 4] and seq.tolist()[:4] == [0, 0, 0, 0] and start.tolist()[:4] == [0, 16, 32, 48]
    assert meta[1].tolist() == [16, 31, 1, 1, 0]
    assert meta[3].tolist() == [48, 63, 2**31 - 1, -(2**31), 1]
    # search columns: prefix max of max block, suffix min of min block, next global tile,
    # suffix min of min position, prefix max of max position (what the kernels binary-search)
    assert search[:4].tolist() == [
        [0, 0, 3, 0, 15],
        [1, 1, 3, 16, 31],
        [2, 2, 3, 32, 47],
        [2, 2**31 - 1, 3, 48, 63],
    ]


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


@pytest.mark.parametrize("backend", ["default", "triton"])
def test_no_visible_key_rows(device, backend, monkeypatch):
    """Rows that see no key: out 0, lse -inf, no NaN, also in the gradient."""
    use_kernel_backend(monkeypatch, device, backend)
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
    use_kernel_backend(monkeypatch, device, backend)
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


def test_plan_cache_sees_in_place_edits(device, monkeypatch):
    """The launchers cache tile metadata per index tensor: an in-place edit must invalidate it."""
    use_kernel_backend(monkeypatch, device, "triton")
    args = list(_case([96], [96], 2, 1, 64, torch.float32, device, blocks="one", gen=torch.Generator().manual_seed(5)))
    args[7] = torch.arange(96, dtype=torch.int32, device=device) // 32  # 3 independent chunks of 32
    args[8] = args[7].clone()
    out1, _ = ragattn.varlen_attention(*args)
    args[7].fill_(-1)  # every token global: tile pairs skipped before must now be computed
    args[8].fill_(-1)
    out2, lse2 = ragattn.varlen_attention(*args)
    o64, l64 = ref_varlen(*_float64(args))
    assert max_abs_err(out2, o64) < 1e-4 and max_abs_err(lse2, l64) < 1e-4
    assert max_abs_err(out1, out2) > 1e-3


_COMPILE_CHECK = r"""
import torch
import ragattn.triton_kernels.varlen_attention as va
from tests.helpers import SM90_CASES, compile_many_sm90

assert not va._INTERPRET
ints = ("QPos", "KPos", "QBlk", "KBlk", "CuQ", "CuK", "QTileSeq", "QTileStart", "QMeta", "KTileOff", "KMeta",
        "KSearch", "KTileSeq", "KTileStart", "QTileOff", "QSearch")
jobs = []
for elt, head_dim in SM90_CASES:
    types = {n: "*i32" for n in ints}
    types.update({n: "*" + elt for n in ("Q", "K", "V", "Out", "DOut", "DQ", "DK", "DV")})
    types.update(Lse="*fp32", Delta="*fp32", qk_scale="fp32", sm_scale="fp32")
    for backward, kernels in [(False, (va._fwd_kernel,)), (True, (va._bwd_dq_kernel, va._bwd_dkdv_kernel))]:
        bm, bn, warps, stages = va._config(head_dim, backward)
        consts = dict(GROUP=4, HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=True, UPCAST=False,
                      PREC="ieee" if elt == "fp32" else "tf32", STEPS=8)
        jobs += [(fn, consts, types, dict(num_warps=warps, num_stages=stages)) for fn in kernels]
    if head_dim == 256:  # the tiny delta kernel: its largest rows only
        jobs.append((va._bwd_preprocess, dict(HEAD_DIM=head_dim, BLOCK=64), types, {}))
compile_many_sm90(jobs)
print("compiled")
"""


def test_kernels_compile_for_sm90():
    """Forward and backward kernels compile for an H100 (sm_90) at the launcher's configs in every
    dtype and head dim, within its shared memory; needs no GPU (a subprocess: this process's
    kernels are interpreter objects)."""
    run_compile_check(_COMPILE_CHECK)
