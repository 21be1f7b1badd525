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
from tests.helpers import (assert_precision, max_abs_err, poison_like, randn_nonzero, require_triton_on,
                           run_compile_check, triton_device, use_kernel_backend)

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


@pytest.mark.parametrize("mask, causal, ratio, dim, dtype", [
    ("none", True, 4, 64, torch.bfloat16),
    ("chunks", False, 1, 128, torch.float16),
    ("sys", True, 8, 64, torch.float32),
    ("random", True, 3, 80, torch.bfloat16),  # padded head dim: no descriptors, the pointer path
])
def test_tma_forward_matches_reference(device, monkeypatch, mask, causal, ratio, dim, dtype):
    """The forward's mask-free loop loading K/V through tensor descriptors (TMA on
    Hopper, emulated by the interpreter; forced by RAGATTN_VARLEN_TMA=1) gives the reference's
    output, GQA 1/3/4/8, a sequence of several full tiles, an empty and a length-1 sequence;
    descriptors are made exactly when the head dim is its own tile."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    use_kernel_backend(monkeypatch, device, "triton")
    monkeypatch.setenv("RAGATTN_VARLEN_TMA", "1")
    made = []
    real = TensorDescriptor.from_tensor
    monkeypatch.setattr(TensorDescriptor, "from_tensor", lambda t, b: made.append(tuple(b)) or real(t, b))
    lens = [70, 0, 45, 1]
    hkv = 1 if ratio == 8 else 2
    args = _case(lens, lens, hkv * ratio, hkv, dim, dtype, device, blocks=mask, causal=causal,
                 gen=torch.Generator().manual_seed(3))
    out, lse = ragattn.varlen_attention(*args)
    o64, l64 = ref_varlen(*_float64(args))
    o_lp, l_lp = ref_varlen(*args, upcast=False)
    assert_precision(out, o64, o_lp, what="out")
    assert_precision(lse, l64, l_lp, what="lse")
    if device.type == "cpu":
        assert (len(made) == 2) == (dim in (64, 128)), made


@pytest.mark.parametrize("ratio, dim, dtype, window", [(8, 256, torch.float16, 40), (4, 128, torch.bfloat16, -1)])
def test_tma_forward_with_windows_and_split_rows(device, monkeypatch, ratio, dim, dtype, window):
    """The TMA loads (emulated by the interpreter) at head dims 256 and 128, GQA 8 and 4,
    under a window, in long rows split over several programs and merged (split_len=2 tiles), with
    16-row tiles (several whole key tiles per row tile); an empty and a length-1 sequence; into
    poisoned outputs."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ragattn.triton_kernels.varlen_attention import varlen_attention_fwd

    require_triton_on(device)
    monkeypatch.setenv("RAGATTN_VARLEN_TMA", "1")
    made = []
    real = TensorDescriptor.from_tensor
    monkeypatch.setattr(TensorDescriptor, "from_tensor", lambda t, b: made.append(tuple(b)) or real(t, b))
    lens = [50, 0, 1, 37]
    hkv = 1 if ratio == 8 else 2
    args = _case(lens, lens, hkv * ratio, hkv, dim, dtype, device, gen=torch.Generator().manual_seed(dim))
    out, lse = poison_like(args[0]), poison_like(args[0][..., 0].float())
    varlen_attention_fwd(*args, None, window, block_m=16, block_n=16, split_len=2, out=out, lse=lse)
    if device.type == "cpu":
        assert made == [(16, dim), (16, dim)]
    o64, l64 = ref_varlen(*_float64(args), None, window)
    o_lp, l_lp = ref_varlen(*args, None, window, upcast=False)
    assert_precision(out, o64, o_lp, what="out")
    assert_precision(lse, l64, l_lp, what="lse")


def test_tma_descriptors_only_where_they_apply(monkeypatch):
    """The TMA switch: RAGATTN_VARLEN_TMA=0 wins over the table; without the variable the table's
    flag decides (never in the interpreter); a padded head dim, a misaligned or non-contiguous K/V
    or no keys keep the pointer loads."""
    import ragattn.triton_kernels.varlen_attention as va
    from tests.helpers import cuda_usable

    # the interpreter emulates descriptors over CPU tensors; compiled kernels need a Hopper GPU's
    # (CPU tensors there get none: the first H100 run failed this test on exactly that)
    if va._INTERPRET:
        dev = torch.device("cpu")
    elif cuda_usable() and torch.cuda.get_device_capability()[0] >= 9:
        dev = torch.device("cuda")
    else:
        pytest.skip("TMA descriptors need the interpreter or a GPU of compute capability >= 9")
    k = torch.randn(40, 2, 64).bfloat16().to(dev)
    v = torch.randn(40, 2, 64).bfloat16().to(dev)
    monkeypatch.setenv("RAGATTN_VARLEN_TMA", "1")
    kd, vd = va._tma_descriptors(k, v, 64, 32, False)
    assert kd is not None and list(kd.block_shape) == [32, 64] and list(kd.shape) == [40, 128]
    assert va._tma_descriptors(k, v, 64, 32, True)[0] is not None
    monkeypatch.setenv("RAGATTN_VARLEN_TMA", "0")
    assert va._tma_descriptors(k, v, 64, 32, True) == (None, None)
    monkeypatch.delenv("RAGATTN_VARLEN_TMA")
    if va._INTERPRET:
        assert va._tma_descriptors(k, v, 64, 32, True) == (None, None)  # the interpreter needs the explicit 1
    else:
        assert va._tma_descriptors(k, v, 64, 32, True)[0] is not None  # the table's flag decides
        assert va._tma_descriptors(k.cpu(), v.cpu(), 64, 32, True) == (None, None)  # never CPU tensors
    assert va._tma_descriptors(k, v, 64, 32, False) == (None, None)
    monkeypatch.setenv("RAGATTN_VARLEN_TMA", "1")
    k80 = torch.randn(40, 2, 80).bfloat16().to(dev)
    assert va._tma_descriptors(k80, k80.clone(), 80, 32, True) == (None, None)  # padded to 128
    base = torch.randn(40 * 2 * 64 + 1).bfloat16().to(dev)
    shifted = base[1:].view(40, 2, 64)  # 2-byte offset: not 16-byte aligned
    assert va._tma_descriptors(shifted, v, 64, 32, True) == (None, None)
    assert va._tma_descriptors(k.transpose(1, 2).contiguous().transpose(1, 2), v, 64, 32, True) == (None, None)
    assert va._tma_descriptors(k[:0], v[:0], 64, 32, True) == (None, None)


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

    require_triton_on(device)
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
    from ragattn.triton_kernels.varlen_plan import tile_metadata, tile_pairs

    cu = torch.tensor([0, 64], dtype=torch.int32, device=device)
    pos = torch.arange(64, dtype=torch.int32, device=device)
    blk = (pos // 16).int()
    blk[48:] = -1
    off, seq, start, meta = tile_metadata(cu, pos, blk, 64, 16)
    assert off.tolist() == [0, 4] and seq.tolist() == [0, 0, 0, 0] and start.tolist() == [0, 16, 32, 48]
    assert meta[1].tolist() == [16, 31, 1, 1, 0]
    assert meta[3].tolist() == [48, 63, 2**31 - 1, -(2**31), 1]
    qt, kt = torch.cartesian_prod(torch.arange(4), torch.arange(4)).unbind(1)
    any_vis, all_vis = tile_pairs(meta, meta, qt, kt, True, -1)
    # chunk tiles see themselves (the diagonal: partially, causal) and nothing else; the global
    # tile sees every earlier tile in full and itself partially
    assert any_vis.view(4, 4).int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [1, 1, 1, 1]]
    assert all_vis.view(4, 4).int().tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]]


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
    torch.library.opcheck(OP.default, (q, k, v) + tuple(args[3:]), {"scale": 0.1, "window_left": 4})


@pytest.mark.parametrize(
    "mutate, exc, words",
    [
        (lambda a: a.update(q=a["q"].long()), TypeError, "q must be"),
        (lambda a: a.update(k=a["k"].half()), TypeError, "k must be"),
        (lambda a: a.update(v=a["v"][:, :, :32]), ValueError, "v must have shape"),
        (lambda a: a.update(k=a["k"][:, :, :32], v=a["v"][:, :, :32]), ValueError, "k must have shape"),
        (lambda a: a.update(q=torch.cat([a["q"]] * 3, 1)[:, :3]), ValueError, "multiple"),
        (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].float()), TypeError, "cu_seqlens_q"),
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
ints = ("QPos", "KPos", "QBlk", "KBlk", "Work", "KvRows", "QRows")
jobs, seen = [], set()
# every config the table can pick on an sm_90 GPU: the default and the H100/H200 entries
for device in ("default", "NVIDIA H100 80GB HBM3", "NVIDIA H200"):
  for elt, head_dim in SM90_CASES + (("bf16", 96),):  # 96: BLOCK_D padded to 128, masked (forward only)
    types = {n: "*i32" for n in ints}
    types.update({n: "*" + elt for n in ("Q", "K", "V", "Out", "DOut", "DQ", "DK", "DV")})
    types.update(Lse="*fp32", Delta="*fp32", Parts="*fp32", PartsLse="*fp32", qk_scale="fp32", sm_scale="fp32",
                 softcap_log2="fp32")
    for backward, kernel, fn, window in [(False, "fwd", va._fwd_kernel, False), (False, "fwd", va._fwd_kernel, True),
                                         (True, "dq", va._bwd_dq_kernel, True), (True, "dkdv", va._bwd_dkdv_kernel, True)]:
        bm, bn, warps, stages = va._config(head_dim, kernel, dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32)[elt], window, device)
        consts = dict(GROUP=4, HEAD_DIM=head_dim, BLOCK_D=va.block_d(head_dim), BLOCK_M=bm, BLOCK_N=bn, CAUSAL=True,
                      WINDOW=window, UPCAST=False, PREC="ieee" if elt == "fp32" else "tf32", SOFTCAP=False)
        if head_dim == 96 and backward:
            continue
        key = (fn.__name__, elt, head_dim, window, bm, bn, warps, stages)
        if key not in seen:
            seen.add(key)
            jobs.append((fn, consts, types, dict(num_warps=warps, num_stages=stages)))
            if head_dim == 256 and elt == "bf16" and window:  # Gemma 2's layers: soft-capped, windowed, d 256
                jobs.append((fn, dict(consts, SOFTCAP=True), types, dict(num_warps=warps, num_stages=stages)))
    if head_dim == 256 and device == "default":  # the tiny delta kernel: its largest rows only
        jobs.append((va._bwd_preprocess, dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK=64), types, {}))
# The launcher's configs do not spill for sm_90, forward or backward, in any dtype/head dim
spills = [(job[0].__name__, job[1].get("HEAD_DIM"), job[1].get("WINDOW"), job[2]["Q"], r["spill_stores"], r["spill_loads"])
          for job, r in zip(jobs, compile_many_sm90(jobs, ptxas=True)) if r["spill_stores"] or r["spill_loads"]]
assert not spills, spills
print("compiled")
"""


def test_kernels_compile_for_sm90():
    """Forward and backward kernels compile for an H100 (sm_90) at every config the table gives an
    sm_90 GPU (default, H100, H200 entries) in every dtype and head dim, within its shared memory
    and without spills; needs no GPU (a subprocess: this process's
    kernels are interpreter objects)."""
    run_compile_check(_COMPILE_CHECK)


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


# ----------------------------------------------------------------------------------------------
# A non-finite value of a key a query cannot see never reaches that query
# ----------------------------------------------------------------------------------------------
def _poisoned_case(device, dtype, kind):
    """4 causal tokens with v[3] (or k[3]) poisoned; or Block-Attention blocks / a window."""
    g = torch.Generator().manual_seed(21)
    n = 4 if kind == "causal" else 40
    q, k, v, cu, _, *_ = _case([n], [n], 4, 2, 64, dtype, device, gen=g)
    q_blk = kv_blk = None
    window = -1
    bad = [3]
    if kind == "blocks":  # chunks 0..9 / 10..19 / 20..39 independent: poison a chunk-0 and a chunk-2 key
        q_blk = kv_blk = torch.tensor([0] * 10 + [1] * 10 + [2] * 20, dtype=torch.int32, device=device)
        bad = [2, 37]
    elif kind == "window":  # window of 8: key 5 is out of every query >= 14's window
        window = 8
        bad = [5]
    return q, k, v, cu, q_blk, kv_blk, window, bad


def _blind_rows(n, kind, bad, window):
    """Query rows that see none of the poisoned keys."""
    from ragattn.reference.varlen_attention import visible_mask

    pos = torch.arange(n, dtype=torch.int32)
    blk = torch.tensor([0] * 10 + [1] * 10 + [2] * 20, dtype=torch.int32) if kind == "blocks" else torch.full((n,), -1, dtype=torch.int32)
    vis = visible_mask(pos, pos, blk, blk, True, window)
    return (~vis[:, bad].any(1)).nonzero().flatten()


@pytest.mark.parametrize("backend", ["default", "triton"])
@pytest.mark.parametrize("kind", ["causal", "blocks", "window"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_masked_nonfinite_never_reaches_a_query(device, backend, monkeypatch, kind, poison):
    use_kernel_backend(monkeypatch, device, backend)
    dtype = torch.float32 if backend == "default" else torch.float16
    q, k, v, cu, q_blk, kv_blk, window, bad = _poisoned_case(device, dtype, kind)
    blind = _blind_rows(q.shape[0], kind, bad, window)
    assert blind.numel() >= 3
    clean_args = (q, k, v, cu, cu, None, None, q_blk, kv_blk, True, None, window)
    want, want_lse = ref_varlen(*_float64(clean_args))
    vp, kp = v.clone(), k.clone()
    vp[bad, 1, 5] = poison
    kp[bad, 0, 7] = -poison  # K too: its score is masked, but the backward multiplies dS by K
    leaves = [t.detach().requires_grad_(True) for t in (q, kp, vp)]
    out, lse = ragattn.varlen_attention(*leaves, cu, cu, None, None, q_blk, kv_blk, True, None, window)
    assert torch.isfinite(out[blind]).all() and torch.isfinite(lse[blind]).all()
    assert max_abs_err(out[blind], want[blind]) < 2e-3 and max_abs_err(lse[blind], want_lse[blind]) < 2e-3
    # the queries that do see a poisoned key are not silently finite
    seen = torch.ones(q.shape[0], dtype=torch.bool)
    seen[blind] = False
    assert not torch.isfinite(out[seen]).all(dim=(1, 2)).any()
    # gradients: only rows whose loss terms are finite, dq of a blind row must be finite and right
    dout = torch.zeros_like(out)
    dout[blind] = randn_nonzero(blind.numel(), *out.shape[1:], dtype=dtype, device=device, generator=torch.Generator().manual_seed(3))
    dq = torch.autograd.grad(out, leaves[0], dout)[0]
    ql = q.double().requires_grad_(True)
    want_dq = torch.autograd.grad(ref_varlen(ql, *_float64(clean_args[1:]))[0], ql, dout.double())[0]
    assert torch.isfinite(dq[blind]).all()
    assert max_abs_err(dq[blind], want_dq[blind]) < 5e-3


# ----------------------------------------------------------------------------------------------
# Fake impl validates, named errors, inference mode
# ----------------------------------------------------------------------------------------------
def test_meta_tensor_mixed_with_cpu_raises():
    q, k, v, cu_q, cu_k, *_ = _case([5, 6], [5, 7], 4, 2, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="ragattn.varlen_attention: all tensors must be on one device"):
        ragattn.varlen_attention(q.to("meta"), k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match="ragattn.varlen_attention: all tensors must be on one device"):
        ragattn.varlen_attention(q, k, v.to("meta"), cu_q, cu_k)


def test_fake_impl_validates_like_the_real_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, cu_q, cu_k, *_ = _case([5, 6], [5, 7], 4, 2, 64, torch.float32, "cpu")
    with FakeTensorMode() as mode:
        fq, fk, fv, fcq, fck = (mode.from_tensor(t) for t in (q, k, v, cu_q, cu_k))
        out, lse = ragattn.varlen_attention(fq, fk, fv, fcq, fck)
        assert out.shape == q.shape and lse.shape == q.shape[:2]
        with pytest.raises(ValueError, match="v must have shape"):
            ragattn.varlen_attention(fq, fk, fv[:, :, :32], fcq, fck)
        with pytest.raises(TypeError, match="k must be"):
            ragattn.varlen_attention(fq, fk.half(), fv.half(), fcq, fck)
        with pytest.raises(ValueError, match="multiple"):
            ragattn.varlen_attention(fq[:, :3], fk, fv, fcq, fck)
        with pytest.raises(ValueError, match="q_pos"):
            ragattn.varlen_attention(fq, fk, fv, fcq, fck, fcq)


def test_head_dim_zero_is_a_named_error():
    q, k, v, cu_q, cu_k, *_ = _case([5], [5], 2, 1, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="ragattn.varlen_attention: q must have head_dim > 0"):
        ragattn.varlen_attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], cu_q, cu_k)


@pytest.mark.parametrize("backend", ["default", "triton"])
def test_inference_mode(device, backend, monkeypatch):
    """Serving runs under torch.inference_mode(): forward and out= on every backend, with the
    plan cache (which cannot see in-place edits of inference tensors) bypassed."""
    use_kernel_backend(monkeypatch, device, backend)
    with torch.inference_mode():
        args = list(_case([40, 3], [40, 3], 4, 2, 64, torch.float32, device, blocks="chunks", gen=torch.Generator().manual_seed(9)))
        out, lse = ragattn.varlen_attention(*args, None, 5)
        o64, l64 = ref_varlen(*_float64(args), None, 5)
        assert max_abs_err(out, o64) < 1e-4 and max_abs_err(lse, l64) < 1e-4
        args[8].fill_(-1)  # in-place edit of an inference tensor: the next call must see it
        args[7].fill_(-1)
        out2, _ = ragattn.varlen_attention(*args, None, 5)
        assert max_abs_err(out2, ref_varlen(*_float64(args), None, 5)[0]) < 1e-4
        o_buf, l_buf = poison_like(out), poison_like(lse)
        ragattn.varlen_attention(*args, None, 5, out=o_buf, lse_out=l_buf)
        assert torch.equal(o_buf, out2)


# ----------------------------------------------------------------------------------------------
# Engine-style inputs (int64 indices, out= / lse_out=)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["default", "triton"])
def test_int64_indices(device, backend, monkeypatch):
    use_kernel_backend(monkeypatch, device, backend)
    args = _case([30, 0, 17], [30, 2, 17], 4, 2, 64, torch.float32, device, blocks="sys", pos="shuffled",
                 gen=torch.Generator().manual_seed(13))
    args64 = [a.long() if torch.is_tensor(a) and not a.is_floating_point() else a for a in args]
    out32, lse32 = ragattn.varlen_attention(*args, None, 7)
    out64, lse64 = ragattn.varlen_attention(*args64, None, 7)
    assert torch.equal(out32, out64) and torch.equal(lse32, lse64)
    o64, _ = ref_varlen(*_float64(args64), None, 7)
    assert max_abs_err(out64, o64) < 1e-4


def test_int64_positions_outside_int32_refused():
    q, k, v, cu_q, cu_k, *_ = _case([5], [5], 2, 1, 64, torch.float32, "cpu")
    pos = torch.arange(5, dtype=torch.int64) + 2**31
    with pytest.raises(ValueError, match="q_pos values must fit in int32"):
        ragattn.varlen_attention(q, k, v, cu_q, cu_k, pos)


@pytest.mark.parametrize("backend", ["default", "triton"])
def test_out_variant(device, backend, monkeypatch):
    use_kernel_backend(monkeypatch, device, backend)
    args = _case([21, 4], [21, 9], 4, 2, 64, torch.float16, device, blocks="chunks", pos="offset",
                 gen=torch.Generator().manual_seed(14))
    want_o, want_l = ragattn.varlen_attention(*args, None, 6)
    out, lse = poison_like(want_o), poison_like(want_l)
    got_o, got_l = ragattn.varlen_attention(*args, None, 6, out=out, lse_out=lse)
    assert got_o is out and got_l is lse
    assert torch.equal(out, want_o) and torch.equal(lse, want_l)
    torch.library.opcheck(torch.ops.ragattn.varlen_attention.out, tuple(args) + (None, 6),
                          {"out": poison_like(want_o), "lse_out": poison_like(want_l)})


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda q: (torch.empty(q.shape[0] + 1, *q.shape[1:]), None), "out must have shape"),
        (lambda q: (torch.empty_like(q, dtype=torch.float64), None), "out must be float32"),
        (lambda q: (torch.empty(q.shape[0], q.shape[2], q.shape[1]).transpose(1, 2), None), "out must be contiguous"),
        (lambda q: (None, torch.empty(q.shape[0], q.shape[1], dtype=torch.float16)), "lse_out must be float32"),
        (lambda q: (q, None), "out must not share memory with q"),
        (lambda q: (torch.empty_like(q, device="meta"), None), "out must be on cpu"),
    ],
)
def test_out_variant_refuses_bad_buffers(make, words):
    q, k, v, cu_q, cu_k, *_ = _case([5, 6], [5, 7], 4, 2, 64, torch.float32, "cpu")
    out, lse = make(q)
    with pytest.raises(ValueError if "float" not in words else TypeError, match=words):
        ragattn.varlen_attention(q, k, v, cu_q, cu_k, out=out, lse_out=lse)


def test_out_variant_refuses_overlapping_lse_and_out():
    q, k, v, cu_q, cu_k, *_ = _case([5, 6], [5, 7], 4, 2, 64, torch.float32, "cpu")
    buf = torch.empty(q.numel() + 44)
    with pytest.raises(ValueError, match="out must not share memory with lse_out"):
        ragattn.varlen_attention(q, k, v, cu_q, cu_k, out=buf[: q.numel()].view(q.shape), lse_out=buf[q.numel() - 4:][: 44].view(11, 4))


def test_out_variant_under_compile():
    """The out= overload mutates its buffers and returns nothing: torch.compile functionalises it."""
    args = _case([9, 4], [9, 6], 4, 2, 64, torch.float32, "cpu", blocks="chunks", gen=torch.Generator().manual_seed(15))

    def f(o, l, *a):
        torch.ops.ragattn.varlen_attention.out(*a, None, 3, out=o, lse_out=l)
        return o * 2, l

    want = ragattn.varlen_attention(*args, None, 3)
    o, l = poison_like(want[0]), poison_like(want[1])
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(o, l, *args)
    assert torch.equal(got[0], want[0] * 2) and torch.equal(o, want[0]) and torch.equal(l, want[1])


# ----------------------------------------------------------------------------------------------
# Head dims that are not powers of two run in Triton (BLOCK_D padded and masked)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim, dtype", [(80, torch.bfloat16), (96, torch.float32), (112, torch.float16)])
def test_padded_head_dims_run_in_triton(device, monkeypatch, dim, dtype):
    from ragattn.ops.varlen_attention import _use_triton

    use_kernel_backend(monkeypatch, device, "triton")
    args = _case([29, 1, 18], [29, 1, 18], 6, 2, dim, dtype, device, blocks="chunks", gen=torch.Generator().manual_seed(dim))
    assert _use_triton(args[0])
    leaves = [t.detach().requires_grad_(True) for t in args[:3]]
    out, lse = ragattn.varlen_attention(*leaves, *args[3:], None, 9)
    o64, l64 = ref_varlen(*_float64(args), None, 9)
    o_lp, l_lp = ref_varlen(*args, None, 9, upcast=False)
    assert_precision(out, o64, o_lp, what="out")
    assert_precision(lse, l64, l_lp, what="lse")
    dout = randn_nonzero(*out.shape, dtype=dtype, device=device, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, leaves, dout)
    l64s = [t.detach().double().requires_grad_(True) for t in args[:3]]
    want64 = torch.autograd.grad(ref_varlen(*l64s, *args[3:], None, 9)[0], l64s, dout.double())
    llp = [t.detach().requires_grad_(True) for t in args[:3]]
    want_lp = torch.autograd.grad(ref_varlen(*llp, *args[3:], None, 9, upcast=False)[0], llp, dout)
    for name, g, w64, wlp in zip(("dq", "dk", "dv"), got, want64, want_lp):
        assert_precision(g, w64, wlp, what=name)


@pytest.mark.parametrize("backend", ["triton", "default"])
@pytest.mark.parametrize("ratio, dim, dtype, mask, causal, window", [
    (8, 256, torch.bfloat16, "chunks", True, 9),
    (4, 80, torch.float16, "random", False, 20),
])
def test_head_dims_gqa_and_windows_forward_backward(device, seed, backend, monkeypatch, ratio, dim, dtype, mask, causal,
                                                    window):
    """Forward and backward at head dims 256 and 80 without a soft cap (test_soft_cap
    runs them with one), GQA 8 and 4 under a window, blocks; lengths off the tiles, an empty and a
    length-1 sequence; the forward into poisoned out=/lse_out= buffers."""
    use_kernel_backend(monkeypatch, device, backend)
    lens_q, lens_k = _lens("default")
    hkv = 1 if ratio == 8 else 2
    args = _case(lens_q, lens_k, hkv * ratio, hkv, dim, dtype, device, blocks=mask, causal=causal,
                 gen=torch.Generator().manual_seed(seed)) + (None, window)
    out, lse = poison_like(args[0]), poison_like(args[0][..., 0].float())
    ragattn.varlen_attention(*args, out=out, lse_out=lse)
    o64, l64 = ref_varlen(*_float64(args))
    o_lp, l_lp = ref_varlen(*args, upcast=False)
    assert_precision(out, o64, o_lp, what="out")
    assert_precision(lse, l64, l_lp, what="lse")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(l64)) and (out[torch.isneginf(l64)] == 0).all()
    _check_gradients(args, randn_nonzero(*out.shape, dtype=dtype, device=device,
                                          generator=torch.Generator().manual_seed(seed + 1)))


def test_more_work_items_than_a_cuda_grid_axis_holds(monkeypatch):
    """CUDA's grid axes y and z stop at 65535 programs, and a long packed batch has
    more work items than that (1M query rows are 16K-64K tiles). Every launch keeps axes 1 and 2
    within the limit (recorded with a plan that claims 70,000 items per side; nothing runs)."""
    import dataclasses

    import ragattn.triton_kernels.varlen_attention as va

    grids = []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(tuple(grid))
            return lambda *a, **kw: None

    for name in ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"):
        monkeypatch.setattr(va, name, Recorder())
    real = va._cached_plan
    plan_csr = []

    def many_items(*a, **kw):
        plan = real(*a, **kw)
        plan_csr.append(plan.by_q)
        many = lambda csr: csr if csr is None else dataclasses.replace(csr, work=csr.work.new_zeros(70_000, 8))  # noqa: E731
        return dataclasses.replace(plan, by_q=many(plan.by_q), by_k=many(plan.by_k))

    monkeypatch.setattr(va, "_cached_plan", many_items)
    args = _case([40, 3], [40, 3], 4, 2, 64, torch.float32, triton_device(), blocks="chunks")
    out, lse = va.varlen_attention_fwd(*args[:9], True, None)
    va.varlen_attention_bwd(torch.ones_like(out), *args[:3], out, lse, *args[3:9], True, None)
    assert len(grids) == 3, grids
    for grid, heads in zip(grids, (4, 4, 2)):   # forward, dq (query heads), dk/dv (kv heads)
        assert grid[0] == heads and all(g <= 65535 for g in grid[1:]) and math.prod(grid[1:]) >= 70_000, grid
    # the padding items (the grid's last row past 70,000) are empty: no rows, written in place
    grid, work = va._launch(4, dataclasses.replace(plan_csr[0], work=plan_csr[0].work.new_ones(70_000, 8)))
    assert grid == (4, 65535, 2) and work.shape == (2 * 65535, 8)
    assert (work[70_000:, :6] == 0).all() and (work[70_000:, 6] == -1).all() and (work[:70_000] == 1).all()


# ----------------------------------------------------------------------------------------------
# The launch plan (visible key tiles per query tile, longest first, split long rows)
# ----------------------------------------------------------------------------------------------
def _tile_visibility(args, bm, bn):
    """Dense [q tiles, k tiles] any/all visibility (all: every pair visible and the key tile full)."""
    from ragattn.reference.varlen_attention import visible_mask

    q, k, _, cu_q, cu_k, q_pos, kv_pos, q_blk, kv_blk, causal = args[:10]
    window = args[11] if len(args) > 11 else -1
    anys, alls, q_tiles, k_tiles = [], [], [], []
    for b in range(cu_q.numel() - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qp = torch.arange(qe - qs, dtype=torch.int32) if q_pos is None else q_pos[qs:qe]
        kp = torch.arange(ke - ks, dtype=torch.int32) if kv_pos is None else kv_pos[ks:ke]
        qb = torch.full((qe - qs,), -1, dtype=torch.int32) if q_blk is None else q_blk[qs:qe]
        kb = torch.full((ke - ks,), -1, dtype=torch.int32) if kv_blk is None else kv_blk[ks:ke]
        vis = visible_mask(qp, kp, qb, kb, causal, window)
        for i in range(0, qe - qs, bm):
            for j in range(0, ke - ks, bn):
                t = vis[i:i + bm, j:j + bn]
                q_tiles.append(qs + i)
                k_tiles.append(ks + j)
                anys.append(bool(t.any()))
                alls.append(bool(t.all()) and j + bn <= ke - ks)
    return q_tiles, k_tiles, anys, alls


@pytest.mark.parametrize("mask, causal, pos, window", [("chunks", True, "default", -1), ("sys", False, "offset", -1),
                                                       ("random", True, "shuffled", 5), ("many", True, "default", 9)])
def test_plan_lists_every_visible_tile_once_longest_first(mask, causal, pos, window):
    """The plan's work items cover exactly the visible tile pairs, fully visible ones in the
    mask-free range, split rows in consecutive pieces, and launch in descending order of work."""
    from ragattn.triton_kernels.varlen_plan import build_plan

    lens_k = [70, 0, 33, 1, 40]
    lens_q = [30, 0, 33, 1, 40] if pos == "offset" else lens_k
    args = _case(lens_q, lens_k, 2, 1, 16, torch.float32, "cpu", blocks=mask, causal=causal, pos=pos,
                 gen=torch.Generator().manual_seed(11)) + (None, window)
    bm, bn = 16, 8
    plan = build_plan(*args[3:9], sum(lens_q), sum(lens_k), block_m=bm, block_n=bn, causal=causal,
                      window_left=window, backward=True, split_len=2)
    q_tiles, k_tiles, anys, alls = _tile_visibility(args, bm, bn)
    visible = {(qt, kt) for qt, kt, a in zip(q_tiles, k_tiles, anys) if a}
    in_full = {(qt, kt) for qt, kt, full in zip(q_tiles, k_tiles, alls) if full}
    for csr, swap in ((plan.by_q, False), (plan.by_k, True)):
        work, rows = csr.work.long(), csr.rows.long()
        sizes = (work[:, 5] - work[:, 3]).tolist()
        assert sizes == sorted(sizes, reverse=True)  # longest first
        got = {}
        for start, end_row, _, e0, e1, e2, dest, _ in work.tolist():
            assert e0 <= e1 <= e2 and start < end_row
            for e in range(e0, e2):
                pair = (rows[e].item(), start) if swap else (start, rows[e].item())
                assert pair not in got, "a tile pair listed twice"
                got[pair] = e < e1
        # every visible pair is listed (the metadata may add a few invisible ones: min/max summaries),
        # and a pair on the mask-free path is visible in full
        assert visible <= set(got) and {p for p, full in got.items() if full} <= in_full
        assert len(got) < len(q_tiles) or not causal  # and tile pairs are skipped
        # every row tile has an item (rows with no visible tile write their zeros)
        cu, block = (args[4], bn) if swap else (args[3], bm)
        tiles = {int(cu[b]) + i for b in range(cu.numel() - 1) for i in range(0, int(cu[b + 1] - cu[b]), block)}
        assert set(work[:, 0].tolist()) == tiles
        assert len(visible) * 2 >= len(got) or mask == "random"
    assert plan.by_q.split_tiles > 0 and plan.by_q.max_splits > 1  # split_len 2 splits long rows
    assert plan.by_k.split_tiles == 0


def test_plan_is_cached_for_equal_and_inference_index_tensors():
    """A model builds new (or inference) index tensors in every layer: equal ones reuse the plan;
    different ones do not."""
    import ragattn.triton_kernels.varlen_attention as va

    cu = torch.tensor([0, 20, 45], dtype=torch.int32)
    blk = torch.arange(45, dtype=torch.int32) // 7
    params = dict(block_m=16, block_n=16, causal=True, window_left=-1, backward=False, split_len=None, split_slots=None)
    first = va._cached_plan((cu, cu, None, None, blk, blk), 45, 45, **params)
    assert va._cached_plan((cu, cu, None, None, blk, blk), 45, 45, **params) is first
    assert va._cached_plan((cu.clone(), cu.clone(), None, None, blk.clone(), blk.clone()), 45, 45, **params) is first
    with torch.inference_mode():
        inf = (cu.clone(), cu.clone(), None, None, blk.clone(), blk.clone())
        assert va._cached_plan(inf, 45, 45, **params) is first
        inf[4][3] = -1  # an in-place edit of an inference tensor is seen by content
        assert va._cached_plan(inf, 45, 45, **params) is not first
    assert va._cached_plan((cu, cu, None, None, blk, blk), 45, 45, **dict(params, causal=False)) is not first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_rows_are_merged(device, dtype):
    """Long rows split over several programs (split_len=2 tiles) and merged: the same answer as
    the float64 reference, including empty sequences, rows with no visible key, GQA, and masked
    NaN/inf keys inside a split row's key range that no query of it can see."""
    from ragattn.triton_kernels.varlen_attention import _cached_plan, varlen_attention_fwd

    require_triton_on(device)
    args = list(_case([45, 0, 3, 38], [45, 5, 0, 38], 4, 2, 64, dtype, device, blocks="chunks",
                      gen=torch.Generator().manual_seed(17)))
    k, v = args[1].clone(), args[2].clone()
    # keys 7..13 form chunk 1 of sequence 0: visible to chunk 1 and the global tail (rows 39..44) only;
    # key 40 (global tail) lies in the causal future of every row before it
    bad = [9, 40]
    k[bad, 0, 3] = float("nan")
    v[bad, 1, 5] = float("inf")
    args[1], args[2] = k, v
    out, lse = varlen_attention_fwd(*args, None, block_m=16, block_n=16, split_len=2)
    plan = _cached_plan(tuple(args[3:9]), 86, 88, block_m=16, block_n=16, causal=True, window_left=-1, backward=False,
                        split_len=2, split_slots=None)
    assert plan.by_q.split_tiles >= 2 and plan.by_q.max_splits >= 2
    from ragattn.reference.varlen_attention import visible_mask

    # the expectations on the CPU (the kernel may have run on CUDA)
    out, lse = out.cpu(), lse.cpu()
    args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]

    vis = visible_mask(torch.arange(45, dtype=torch.int32), torch.arange(45, dtype=torch.int32), args[7][:45],
                       args[8][:45], True, -1)
    blind = torch.cat([(~vis[:, bad].any(1)).nonzero().flatten(), torch.arange(48, 86)])  # + sequence 3
    clean = list(args)
    clean[1], clean[2] = clean[1].clone(), clean[2].clone()
    clean[1][bad], clean[2][bad] = 1.0, 1.0
    o64, l64 = ref_varlen(*_float64(clean))
    olp, llp = ref_varlen(*clean)
    assert torch.isfinite(out[blind]).all() and torch.isfinite(lse[blind]).all()
    assert_precision(out[blind], o64[blind], olp[blind], what="out")
    assert_precision(lse[blind], l64[blind], llp[blind], what="lse")
    seen = torch.zeros(86, dtype=torch.bool)
    seen[:45] = vis[:, bad].any(1)
    assert seen.any() and not torch.isfinite(out[seen]).all(dim=(1, 2)).any()  # NaN propagates when seen
    assert torch.isneginf(lse[45:48]).all() and (out[45:48] == 0).all()  # sequence 2 has no keys


# ----------------------------------------------------------------------------------------------
# The default CPU path's Block-Attention split (chunk blocks as short sequences of
# their own, global rows over everything) and REFRAG's encoder layout, forward and backward
# ----------------------------------------------------------------------------------------------
def _block_layout(kind, n_seq_tokens, gen):
    """Block ids of one sequence: 'block_attention' = a global system prompt of 5, chunks of 23
    (the last one shorter), a global tail of 7; 'refrag' = independent chunks of 16 (the last
    one shorter), no global token."""
    if kind == "refrag":
        return [i // 16 for i in range(n_seq_tokens)]
    if n_seq_tokens < 20:  # a short question alone: global
        return [-1] * n_seq_tokens
    body = n_seq_tokens - 5 - 7
    return [-1] * 5 + [i // 23 for i in range(body)] + [-1] * 7


def _check_forward_backward(args, seed):
    """out, lse and dq/dk/dv of ragattn.varlen_attention(*args) against the float64 reference,
    within twice the error of the same computation in the input dtype."""
    out, lse = ragattn.varlen_attention(*args)
    o64, l64 = ref_varlen(*_float64(args))
    o_lp, l_lp = ref_varlen(*args, upcast=False)
    assert_precision(out, o64, o_lp, what="out")
    assert_precision(lse, l64, l_lp, what="lse")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(l64))
    _check_gradients(args, randn_nonzero(*out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed)))


def _check_gradients(args, dout):
    """dq/dk/dv of ragattn.varlen_attention(*args) for the upstream gradient ``dout`` against the
    float64 reference, within twice the error of the same computation in the input dtype."""
    leaves = [t.detach().requires_grad_(True) for t in args[:3]]
    got = torch.autograd.grad(ragattn.varlen_attention(*leaves, *args[3:])[0], leaves, dout)
    l64s = [t.double().requires_grad_(True) for t in args[:3]]
    want64 = torch.autograd.grad(ref_varlen(*l64s, *args[3:])[0], l64s, dout.double())
    llp = [t.detach().requires_grad_(True) for t in args[:3]]
    want_lp = torch.autograd.grad(ref_varlen(*llp, *args[3:], upcast=False)[0], llp, dout)
    for name, g, w64, wlp in zip(("dq", "dk", "dv"), got, want64, want_lp):
        assert_precision(g, w64, wlp, what=name)


@pytest.mark.parametrize("kind, causal, dtype, ratio", [
    ("block_attention", True, torch.bfloat16, 3),
    ("block_attention", False, torch.float32, 1),
    ("refrag", False, torch.float16, 4),
])
def test_block_split_path_matches_reference(kind, causal, dtype, ratio):
    """Sequences long enough that the default CPU path splits them into per-chunk calls (checked),
    with an empty and a length-1 sequence beside them: out, lse, dq, dk, dv vs float64."""
    from ragattn.ops import _varlen_sdpa_cpu

    gen = torch.Generator().manual_seed(21)
    lens = [131, 0, 1, 97]
    hkv = 2
    args = list(_case(lens, lens, hkv * ratio, hkv, 64, dtype, "cpu", causal=causal, gen=gen))
    blk = torch.tensor(sum((_block_layout(kind, n, gen) for n in lens), []), dtype=torch.int32)
    args[7], args[8] = blk, blk.clone()
    groups = _varlen_sdpa_cpu.plan(args[3], args[4], None, None, args[7], args[8], causal, -1, sum(lens), sum(lens))
    assert len(groups) >= 2 or kind == "refrag", "the split path was not taken"
    assert groups[-1].q_idx.shape[0] > 2, "chunks were not batched as sequences of their own"
    _check_forward_backward(args, seed=22)


def test_block_split_path_never_reads_masked_nan():
    """A NaN in the K/V of a chunk another chunk's rows cannot see stays out of those rows on the
    split path (the fused kernel would read it: the result is recomputed by the reference)."""
    gen = torch.Generator().manual_seed(23)
    lens = [131]
    args = list(_case(lens, lens, 4, 2, 64, torch.float32, "cpu", gen=gen))
    blk = torch.tensor(_block_layout("block_attention", 131, gen), dtype=torch.int32)
    args[7], args[8] = blk, blk.clone()
    want, want_lse = ref_varlen(*_float64(args))
    bad = 5 + 23 + 4  # a token of chunk 1
    args[1][bad, 1, 3] = float("nan")
    args[2][bad, 0, 9] = float("nan")
    out, lse = ragattn.varlen_attention(*args)
    # rows that see the token: its chunk's and the global tail's, at or after it (causal)
    blind = ~((torch.arange(131) >= bad) & ((blk == 1) | (blk == -1)))
    assert torch.isfinite(out[blind]).all() and torch.isfinite(lse[blind]).all()
    assert max_abs_err(out[blind], want[blind]) < 1e-4
    assert not torch.isfinite(out[~blind]).all(dim=(1, 2)).any()


@pytest.mark.parametrize("causal", [True, False])
def test_equal_length_sequences_read_as_views(causal):
    """Sequences of one length packed back to back: the default CPU path reads and writes them as
    views of the packed tensors (no gather/scatter); out, lse and the gradients vs float64."""
    from ragattn.ops import _varlen_sdpa_cpu

    args = list(_case([24, 24, 24], [24, 24, 24], 6, 2, 64, torch.float32, "cpu", causal=causal,
                      gen=torch.Generator().manual_seed(31)))
    (group,) = _varlen_sdpa_cpu.plan(args[3], args[4], None, None, None, None, causal, -1, 72, 72)
    assert group.q_span == (0, 72) and group.k_span == (0, 72) and group.q_idx.shape == (3, 24)
    _check_forward_backward(args, seed=32)


# ----------------------------------------------------------------------------------------------
# The default CPU path's fixed cost (direct call, checks once per cached plan)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal, window, pos", [(True, -1, "default"), (True, 9, "default"), (False, 11, "shuffled")])
def test_block_split_trims_unseen_global_keys(causal, window, pos):
    """The split path gives each chunk only the global keys its rows may see (a global tail after
    the chunks is invisible to them when causal; a window cuts the keys far behind): vs float64,
    with NaN in a trimmed tail key (never read, so no reference fallback is needed either)."""
    from ragattn.ops import _varlen_sdpa_cpu

    gen = torch.Generator().manual_seed(41)
    lens = [3, 0, 90]
    args = list(_case(lens, lens, 4, 2, 64, torch.float32, "cpu", causal=causal, pos=pos, gen=gen))
    blk = torch.tensor(sum(([-1] * n if n < 20 else [i // 21 for i in range(n - 6)] + [-1] * 6 for n in lens), []),
                       dtype=torch.int32)
    args[7], args[8] = blk, blk.clone()
    args = args[:10] + [None, window]
    groups = _varlen_sdpa_cpu.plan(*args[3:9], causal, window, 93, 93)
    assert len(groups) == 2 and groups[1].q_idx.shape[0] == 4, "the split path was not taken"
    if causal and pos == "default":
        assert groups[1].k_idx.shape[1] <= 21  # no tail key
    _check_forward_backward(args, seed=42)
    if causal and pos == "default":
        args[1][92, 1, 5] = float("nan")  # the last tail key: only the tail's last row sees it
        out, _ = ragattn.varlen_attention(*args)
        assert torch.isfinite(out[:92]).all() and not torch.isfinite(out[92]).all()


def test_index_value_checks_hold_on_cached_plans():
    """The checks that read index values run once per cached plan: an index tensor edited in place
    (a new version, or for an inference tensor new contents) is checked again."""
    args = list(_case([20, 30], [20, 30], 4, 2, 64, torch.float32, "cpu", blocks="chunks",
                      gen=torch.Generator().manual_seed(43)))
    ragattn.varlen_attention(*args)
    args[3][1] = 60  # cu_seqlens_q no longer non-decreasing
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        ragattn.varlen_attention(*args)
    args[3][1] = 20
    pos = torch.arange(50, dtype=torch.int64)
    ragattn.varlen_attention(*args[:5], pos, pos)
    pos[7] = 2**40
    with pytest.raises(ValueError, match="q_pos values must fit in int32"):
        ragattn.varlen_attention(*args[:5], pos, pos)
    with torch.inference_mode():
        cu = args[4].clone()
        ragattn.varlen_attention(*args[:4], cu)
        cu[2] = 49  # the packed length is 50
        with pytest.raises(ValueError, match="cu_seqlens_k must start at 0 and end at 50"):
            ragattn.varlen_attention(*args[:4], cu)


def test_sdpa_plan_cached_for_equal_and_inference_index_tensors():
    """A model builds new (or inference) index tensors in every layer: the default CPU path reuses
    the plan for equal ones, and sees an in-place edit of an inference tensor."""
    from ragattn.ops import _varlen_sdpa_cpu as sc

    cu = torch.tensor([0, 20, 45], dtype=torch.int32)
    blk = torch.arange(45, dtype=torch.int32) // 7
    first = sc.cached_plan(cu, cu, None, None, blk, blk, True, -1, 45, 45)
    assert sc.cached_plan(cu, cu, None, None, blk, blk, True, -1, 45, 45) is first
    assert sc.cached_plan(cu.clone(), cu.clone(), None, None, blk.clone(), blk.clone(), True, -1, 45, 45) is first
    with torch.inference_mode():
        inf = (cu.clone(), cu.clone(), None, None, blk.clone(), blk.clone())
        assert sc.cached_plan(*inf, True, -1, 45, 45) is first
        inf[4][3] = -1
        assert sc.cached_plan(*inf, True, -1, 45, 45) is not first
    assert sc.cached_plan(cu, cu, None, None, blk, blk, False, -1, 45, 45) is not first


# torch.jit.trace is deprecated in torch itself; the test still checks that tracing sees the op
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
def test_wrapper_dispatches_where_the_op_must_be_seen():
    """The wrapper calls the CPU impl directly only for plain CPU tensors that need no gradient,
    outside modes and transforms; a dispatch mode, FakeTensorMode, a tensor that requires grad and
    torch.compile all still see ``ragattn::varlen_attention`` (and get the same result)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from ragattn.ops._direct_call import plain_cpu_call

    args = list(_case([30, 5], [30, 5], 4, 2, 64, torch.float32, "cpu", blocks="chunks",
                      gen=torch.Generator().manual_seed(44)))
    want = OP(*args)
    got = ragattn.varlen_attention(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert plain_cpu_call(*args[:9])
    with torch.inference_mode():
        assert plain_cpu_call(*args[:9])

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            self.ops.append(str(func))
            return func(*a, **(kw or {}))

    with Record() as rec:
        ragattn.varlen_attention(*args)
    assert any("ragattn.varlen_attention" in o for o in rec.ops), rec.ops[:5]
    traced = torch.jit.trace(lambda q, k, v: ragattn.varlen_attention(q, k, v, *args[3:])[0], tuple(args[:3]))
    assert "ragattn::varlen_attention" in str(traced.graph)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if torch.is_tensor(a) else a for a in args]
        out, lse = ragattn.varlen_attention(*fake)
        assert out.shape == args[0].shape and lse.shape == args[0].shape[:2]
    q = args[0].clone().requires_grad_(True)
    assert not plain_cpu_call(q, *args[1:9])
    out, _ = ragattn.varlen_attention(q, *args[1:])
    assert out.grad_fn is not None and torch.equal(out.detach(), want[0])
    with torch.no_grad():
        assert plain_cpu_call(q, *args[1:9])
    assert not plain_cpu_call(torch.nn.Parameter(args[0]), *args[1:9])


@pytest.mark.parametrize("kind", ["causal", "blocks", "window"])
def test_masked_tiles_in_slices(device, monkeypatch, tmp_path, kind):
    """The forward's masked loop taking each key tile in slices (config ``masked_sub``: what keeps
    a 128 x 64 tile spill-free on sm_90) keeps every rule: against the float64 reference with
    chunk blocks and a global tail, and no masked non-finite value reaching a query."""
    import json

    from ragattn.triton_kernels import gpu_configs

    table = json.load(open(gpu_configs.table_path("varlen_attention", gpu_configs.CONFIG_DIR)))
    table["devices"]["interpreter"]["configs"]["*"]["masked_sub"] = 2
    (tmp_path / "varlen_attention.json").write_text(json.dumps(table))
    monkeypatch.setenv("RAGATTN_CONFIG_DIR", str(tmp_path))
    gpu_configs.clear_cache()
    try:
        test_masked_nonfinite_never_reaches_a_query(device, "triton", monkeypatch, kind, float("nan"))
        if kind == "blocks":
            args = _case([70, 45], [70, 45], 4, 2, 64, torch.float16, device, blocks="chunks")
            _check_forward_backward(args, 5)
    finally:
        monkeypatch.delenv("RAGATTN_CONFIG_DIR")
        gpu_configs.clear_cache()
