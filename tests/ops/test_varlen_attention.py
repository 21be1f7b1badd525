"""ragattn.varlen_attention vs the float64 reference (default path and the Triton kernels).

The Triton kernels run on CPU tensors under TRITON_INTERPRET=1 through RAGATTN_CPU_BACKEND=triton;
interpreter cost ~ programs x loop trips, so the shapes are short and the grid is sampled.
"""
from __future__ import annotations


import pytest
import torch

import ragattn
from ragattn.reference import varlen_attention as ref_varlen
from tests.helpers import (assert_precision, max_abs_err, poison_like, randn_nonzero, require_triton_on,
                           run_compile_check, use_kernel_backend)

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
