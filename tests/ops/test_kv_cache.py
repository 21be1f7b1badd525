"""rerotate_keys_ / copy_kv_ against the float64 reference: dtypes, layouts, awkward sizes,
large positions, round trips, opcheck, and bad inputs that must leave every cache untouched."""
from __future__ import annotations

import pytest
import torch

import ragattn
from ragattn.reference import kv_cache as ref
from tests.helpers import assert_precision, max_abs_err, randn_nonzero

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def inv_freq_for(rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def make_layers(n_layers, shape, dtype, device):
    return [randn_nonzero(*shape, dtype=dtype, device=device) for _ in range(n_layers)]


def rand_rows(num_rows, n, device):
    return torch.randperm(num_rows)[:n].to(device)


def rand_delta(n, device, max_abs=1 << 20):
    return torch.randint(-max_abs, max_abs + 1, (n,), dtype=torch.int32).to(device)


def check_rotated(out_layers, in_layers, rows, delta, inv_freq, rotary_dim, interleaved):
    """Rotated rows meet the precision rule (fp32: also 1e-4 relative); every other row is bit-identical."""
    for out, x in zip(out_layers, in_layers):
        xv = x.view(-1, *x.shape[-2:])
        ov = out.view(-1, *out.shape[-2:])
        got = ov[rows]
        r64 = ref.rope_rotate(xv[rows].double(), delta, inv_freq, rotary_dim, interleaved)
        low = ref.rope_rotate(xv[rows], delta, inv_freq, rotary_dim, interleaved, compute_dtype=None)
        assert_precision(got, r64, low, what="rotated keys")
        if x.dtype == torch.float32 and got.numel():
            assert max_abs_err(got, r64) <= 1e-4 * float(r64.abs().max())
        # dims >= rotary_dim pass through exactly
        assert torch.equal(got[..., rotary_dim:], xv[rows][..., rotary_dim:])
        keep = torch.ones(xv.shape[0], dtype=torch.bool, device=x.device)
        keep[rows] = False
        assert torch.equal(ov[keep], xv[keep])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [64, 32])  # full and partial rotary (head_dim 64)
def test_rerotate_matches_reference(device, seed, dtype, interleaved, rotary_dim):
    layers = make_layers(3, (53, 3, 64), dtype, device)  # 3 layers, 3 KV heads (GQA caches)
    before = [t.clone() for t in layers]
    rows = rand_rows(53, 37, device)
    delta = rand_delta(37, device)
    f = inv_freq_for(rotary_dim).to(device)
    ragattn.rerotate_keys_(layers, rows, delta, f, rotary_dim, interleaved)
    check_rotated(layers, before, rows, delta, f, rotary_dim, interleaved)


@pytest.mark.parametrize("n", [0, 1, 37, 130])
def test_rerotate_awkward_row_counts_paged(device, seed, n):
    # paged layout [pages, page_size, H, D], head_dim 128 with 16-row pages
    layers = make_layers(2, (9, 16, 2, 128), torch.bfloat16, device)
    before = [t.clone() for t in layers]
    rows = rand_rows(144, n, device)
    delta = rand_delta(n, device, max_abs=4096)
    f = inv_freq_for(128).to(device)
    ragattn.rerotate_keys_(layers, rows, delta, f, 128, False)
    check_rotated(layers, before, rows, delta, f, 128, False)


@pytest.mark.parametrize("interleaved", [False, True])
def test_large_positions_fp32_accuracy(device, interleaved):
    """Keys at 0 rotated by 2^20 (and near it) stay within 1e-4 relative of float64, whereas a
    plain fp32 angle product would be visibly off (the test can fail)."""
    f = inv_freq_for(128, base=500000.0).to(device)
    x = randn_nonzero(4, 4, 128, device=device)
    delta = torch.tensor([1 << 20, -(1 << 20), (1 << 20) - 7, 999_983], dtype=torch.int32, device=device)
    layer = x.clone()
    ragattn.rerotate_keys_([layer], torch.arange(4, device=device), delta, f, 128, interleaved)
    r64 = ref.rope_rotate(x.double(), delta, f, 128, interleaved)
    rel = max_abs_err(layer, r64) / float(r64.abs().max())
    assert rel <= 1e-4, rel
    # the naive product delta * inv_freq in fp32 is far worse: make sure the check would catch it
    naive = torch.cos((delta.float()[:, None] * f[None, :]).double()) - torch.cos(delta.double()[:, None] * f.double()[None, :])
    assert float(naive.abs().max()) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip(device, seed, dtype):
    layers = make_layers(2, (40, 2, 64), dtype, device)
    before = [t.clone() for t in layers]
    rows = rand_rows(40, 23, device)
    delta = rand_delta(23, device)
    f = inv_freq_for(64).to(device)
    ragattn.rerotate_keys_(layers, rows, delta, f, 64, False)
    ragattn.rerotate_keys_(layers, rows, -delta, f, 64, False)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(layers, before):
        assert max_abs_err(a, b) <= tol * float(b.abs().max())


def test_zero_delta_is_identity(device):
    layer = randn_nonzero(8, 2, 64, device=device)
    before = layer.clone()
    ragattn.rerotate_keys_([layer], torch.arange(8, device=device), torch.zeros(8, dtype=torch.int32, device=device), inv_freq_for(64).to(device), 64, False)
    assert torch.equal(layer, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["gather", "scatter", "append"])
@pytest.mark.parametrize("rotate", [False, True])
def test_copy_kv(device, seed, dtype, mode, rotate):
    L, H, D, Hv, Dv = 3, 2, 64, 2, 32  # V with its own head_dim
    n_src, n_dst = (61, 29) if mode == "gather" else (29, 61)
    src_k = make_layers(L, (n_src, H, D), dtype, device)
    src_v = make_layers(L, (n_src, Hv, Dv), dtype, device)
    dst_k = make_layers(L, (n_dst, H, D), dtype, device)
    dst_v = make_layers(L, (n_dst, Hv, Dv), dtype, device)
    n = 17
    if mode == "gather":
        src_rows, dst_rows = rand_rows(n_src, n, device), torch.arange(n, device=device)
    elif mode == "scatter":
        src_rows, dst_rows = torch.arange(n, device=device), rand_rows(n_dst, n, device)
    else:  # append after a prefix, with a repeated source row
        src_rows = torch.randint(0, n_src, (n,)).to(device)
        dst_rows = torch.arange(n_dst - n, n_dst, device=device)
    delta = rand_delta(n, device) if rotate else None
    rd = 48 if rotate else 0  # partial rotary
    f = inv_freq_for(48).to(device) if rotate else None
    exp_k = [t.clone() for t in dst_k]
    exp_v = [t.clone() for t in dst_v]
    src_k0 = [t.clone() for t in src_k]
    ref.copy_kv_(exp_k, exp_v, src_k, src_v, src_rows, dst_rows, None, None)  # unrotated copy
    ragattn.copy_kv_(dst_k, dst_v, src_k, src_v, src_rows, dst_rows, delta, f, rd, False)
    for a, b in zip(src_k, src_k0):
        assert torch.equal(a, b)  # sources untouched
    for a, b in zip(dst_v, exp_v):
        assert torch.equal(a, b)  # V copied bit-exactly, never rotated
    if rotate:
        for out, s, e in zip(dst_k, src_k, exp_k):
            got = out[dst_rows]
            r64 = ref.rope_rotate(s[src_rows].double(), delta, f, rd, False)
            low = ref.rope_rotate(s[src_rows], delta, f, rd, False, compute_dtype=None)
            assert_precision(got, r64, low, what="copied keys")
            keep = torch.ones(n_dst, dtype=torch.bool, device=device)
            keep[dst_rows] = False
            assert torch.equal(out[keep], e[keep])
    else:
        for a, b in zip(dst_k, exp_k):
            assert torch.equal(a, b)


def test_copy_kv_k_only_interleaved_paged(device, seed):
    src = make_layers(2, (3, 8, 4, 64), torch.float16, device)
    dst = make_layers(2, (5, 8, 4, 64), torch.float16, device)
    before = [t.clone() for t in dst]
    src_rows = torch.tensor([0, 23, 7, 9], device=device)
    dst_rows = torch.tensor([39, 1, 8, 20], device=device)
    delta = torch.tensor([5, -5, 1 << 19, 0], dtype=torch.int32, device=device)
    f = inv_freq_for(64).to(device)
    ragattn.copy_kv_(dst, [], src, [], src_rows, dst_rows, delta, f, 64, True)
    for out, s, b in zip(dst, src, before):
        ov, sv, bv = out.view(40, 4, 64), s.view(24, 4, 64), b.view(40, 4, 64)
        r64 = ref.rope_rotate(sv[src_rows].double(), delta, f, 64, True)
        low = ref.rope_rotate(sv[src_rows], delta, f, 64, True, compute_dtype=None)
        assert_precision(ov[dst_rows], r64, low)
        keep = torch.ones(40, dtype=torch.bool, device=device)
        keep[dst_rows] = False
        assert torch.equal(ov[keep], bv[keep])


def test_reference_backend(device, monkeypatch, seed):
    if device.type != "cpu":
        pytest.skip("CPU backend switch")
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", "reference")
    layers = make_layers(2, (20, 2, 64), torch.float32, device)
    before = [t.clone() for t in layers]
    rows, delta, f = rand_rows(20, 9, device), rand_delta(9, device), inv_freq_for(64)
    ragattn.rerotate_keys_(layers, rows, delta, f, 64, False)
    check_rotated(layers, before, rows, delta, f, 64, False)


def test_opcheck(device, seed):
    f = inv_freq_for(32).to(device)
    layers = make_layers(2, (12, 2, 32), torch.float32, device)
    rows = torch.tensor([3, 0, 11], device=device)
    delta = torch.tensor([7, -3, 100], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.ragattn.rerotate_keys_.default, (layers, rows, delta, f, 32, False))
    dk, dv = make_layers(2, (10, 2, 32), torch.float32, device), make_layers(2, (10, 2, 32), torch.float32, device)
    sk, sv = make_layers(2, (12, 2, 32), torch.float32, device), make_layers(2, (12, 2, 32), torch.float32, device)
    dst = torch.tensor([9, 2, 4], device=device)
    torch.library.opcheck(torch.ops.ragattn.copy_kv_.default, (dk, dv, sk, sv, rows, dst, delta, f, 32, True))
    torch.library.opcheck(torch.ops.ragattn.copy_kv_.default, (dk, dv, sk, sv, rows, dst))


# ---- bad inputs: clear errors naming op and argument, caches bit-identical ----

def _rerotate_args(device):
    layers = make_layers(2, (10, 2, 32), torch.bfloat16, device)
    return dict(
        k_layers=layers,
        rows=torch.tensor([1, 4, 6], device=device),
        delta=torch.tensor([3, 5, -2], dtype=torch.int32, device=device),
        inv_freq=inv_freq_for(32).to(device),
        rotary_dim=32,
        interleaved=False,
    )


def _bad_rerotate(device):
    cases = []

    def case(name, exc, arg, fix):
        cases.append((name, exc, arg, fix))

    case("rows_dtype", TypeError, "rows", lambda a: a.update(rows=a["rows"].to(torch.int16)))
    case("delta_dtype", TypeError, "delta", lambda a: a.update(delta=a["delta"].to(torch.int16)))
    case("delta_shape", ValueError, "delta", lambda a: a.update(delta=a["delta"][:2]))
    case("rows_2d", ValueError, "rows", lambda a: a.update(rows=a["rows"][None]))
    case("inv_freq_dtype", TypeError, "inv_freq", lambda a: a.update(inv_freq=a["inv_freq"].double()))
    case("inv_freq_shape", ValueError, "inv_freq", lambda a: a.update(inv_freq=a["inv_freq"][:-1]))
    case("rotary_odd", ValueError, "rotary_dim", lambda a: a.update(rotary_dim=31))
    case("rotary_big", ValueError, "rotary_dim", lambda a: a.update(rotary_dim=34))
    case("layer_dtype", TypeError, "k_layers", lambda a: a["k_layers"].append(a["k_layers"][0].new_ones(10, 2, 32, dtype=torch.float32)))
    case("layer_shape", ValueError, "k_layers", lambda a: a["k_layers"].append(a["k_layers"][0].new_ones(11, 2, 32)))
    case("layer_int", TypeError, "k_layers", lambda a: a["k_layers"].append(torch.ones(10, 2, 32, dtype=torch.int32, device=device)))
    case("layer_2d", ValueError, "k_layers", lambda a: a["k_layers"].append(a["k_layers"][0].new_ones(10, 64)))
    case("noncontig", ValueError, "k_layers", lambda a: a["k_layers"].append(a["k_layers"][0].new_ones(10, 32, 2).transpose(1, 2)))
    case("same_layer_twice", ValueError, "k_layers", lambda a: a["k_layers"].append(a["k_layers"][0]))
    case("row_out_of_range", ValueError, "rows", lambda a: a.update(rows=torch.tensor([1, 10, 6], device=device)))
    case("row_negative", ValueError, "rows", lambda a: a.update(rows=torch.tensor([1, -1, 6], device=device)))
    case("rows_repeat", ValueError, "rows", lambda a: a.update(rows=torch.tensor([1, 6, 6], device=device)))
    if device.type == "cpu":
        case("rows_device", ValueError, "rows", lambda a: a.update(rows=a["rows"].to("meta")))
    else:
        case("rows_device", ValueError, "rows", lambda a: a.update(rows=a["rows"].cpu()))
    return cases


@pytest.mark.parametrize("entry", ["wrapper", "torch.ops"])
@pytest.mark.parametrize("case", range(len(_bad_rerotate(torch.device("cpu")))))
def test_rerotate_bad_inputs(device, entry, case):
    name, exc, arg, fix = _bad_rerotate(device)[case]
    if device.type == "cuda" and name in ("row_out_of_range", "row_negative", "rows_repeat"):
        pytest.skip("CUDA row checks are a precondition (RAGATTN_DEBUG=1)")
    a = _rerotate_args(device)
    fix(a)
    before = [t.clone() for t in a["k_layers"]]
    fn = ragattn.rerotate_keys_ if entry == "wrapper" else torch.ops.ragattn.rerotate_keys_
    with pytest.raises(exc) as info:
        fn(a["k_layers"], a["rows"], a["delta"], a["inv_freq"], a["rotary_dim"], a["interleaved"])
    msg = str(info.value)
    assert "ragattn.rerotate_keys_" in msg and arg in msg, msg
    for t, b in zip(a["k_layers"], before):
        assert torch.equal(t, b)


def _copy_args(device):
    return dict(
        dst_k=make_layers(2, (10, 2, 32), torch.float16, device),
        dst_v=make_layers(2, (10, 2, 32), torch.float16, device),
        src_k=make_layers(2, (7, 2, 32), torch.float16, device),
        src_v=make_layers(2, (7, 2, 32), torch.float16, device),
        src_rows=torch.tensor([0, 3, 6], device=device),
        dst_rows=torch.tensor([9, 2, 5], device=device),
        delta=torch.tensor([4, -4, 1000], dtype=torch.int32, device=device),
        inv_freq=inv_freq_for(32).to(device),
        rotary_dim=32,
        interleaved=False,
    )


def _bad_copy(device):
    cases = []

    def case(name, exc, arg, fix):
        cases.append((name, exc, arg, fix))

    case("dst_rows_repeat", ValueError, "dst_rows", lambda a: a.update(dst_rows=torch.tensor([9, 2, 9], device=device)))
    case("dst_rows_range", ValueError, "dst_rows", lambda a: a.update(dst_rows=torch.tensor([9, 10, 5], device=device)))
    case("src_rows_range", ValueError, "src_rows", lambda a: a.update(src_rows=torch.tensor([0, 7, 6], device=device)))
    case("src_rows_dtype", TypeError, "src_rows", lambda a: a.update(src_rows=a["src_rows"].float()))
    case("dst_rows_shape", ValueError, "dst_rows", lambda a: a.update(dst_rows=a["dst_rows"][:2]))
    case("delta_dtype", TypeError, "delta", lambda a: a.update(delta=a["delta"].float()))
    case("delta_shape", ValueError, "delta", lambda a: a.update(delta=a["delta"][:1]))
    case("inv_freq_missing", ValueError, "inv_freq", lambda a: a.update(inv_freq=None))
    case("rotary_zero", ValueError, "rotary_dim", lambda a: a.update(rotary_dim=0))
    case("src_k_dtype", TypeError, "src_k", lambda a: a.update(src_k=[t.float() for t in a["src_k"]]))
    case("src_k_heads", ValueError, "src_k", lambda a: a.update(src_k=[t.new_ones(7, 4, 32) for t in a["src_k"]]))
    case("src_k_layers", ValueError, "src_k", lambda a: a.update(src_k=a["src_k"][:1]))
    case("dst_v_layers", ValueError, "dst_v", lambda a: a.update(dst_v=a["dst_v"][:1]))
    case("dst_v_rows", ValueError, "dst_v", lambda a: a.update(dst_v=[t.new_ones(11, 2, 32) for t in a["dst_v"]]))
    case("dst_k_noncontig", ValueError, "dst_k", lambda a: a["dst_k"].__setitem__(1, a["dst_k"][1].new_ones(10, 32, 2).transpose(1, 2)))
    case("dst_k_mismatch", ValueError, "dst_k", lambda a: a["dst_k"].__setitem__(1, a["dst_k"][1].new_ones(10, 2, 16)))
    case("src_v_dtype", TypeError, "src_v", lambda a: a.update(src_v=[t.bfloat16() for t in a["src_v"]]))
    return cases


@pytest.mark.parametrize("entry", ["wrapper", "torch.ops"])
@pytest.mark.parametrize("case", range(len(_bad_copy(torch.device("cpu")))))
def test_copy_kv_bad_inputs(device, entry, case):
    name, exc, arg, fix = _bad_copy(device)[case]
    if device.type == "cuda" and name in ("dst_rows_repeat", "dst_rows_range", "src_rows_range"):
        pytest.skip("CUDA row checks are a precondition (RAGATTN_DEBUG=1)")
    a = _copy_args(device)
    fix(a)
    caches = a["dst_k"] + a["dst_v"] + a["src_k"] + a["src_v"]
    before = [t.clone() for t in caches]
    fn = ragattn.copy_kv_ if entry == "wrapper" else torch.ops.ragattn.copy_kv_
    with pytest.raises(exc) as info:
        fn(a["dst_k"], a["dst_v"], a["src_k"], a["src_v"], a["src_rows"], a["dst_rows"], a["delta"], a["inv_freq"], a["rotary_dim"], a["interleaved"])
    msg = str(info.value)
    assert "ragattn.copy_kv_" in msg and arg in msg, msg
    for t, b in zip(caches, before):
        assert torch.equal(t, b)


def test_cuda_debug_mode_checks_rows(device, monkeypatch):
    """On CUDA, row ranges/uniqueness are a precondition checked only with RAGATTN_DEBUG=1."""
    if device.type != "cuda":
        pytest.skip("CUDA-only precondition mode (CPU always checks)")
    monkeypatch.setenv("RAGATTN_DEBUG", "1")
    layer = make_layers(1, (10, 2, 32), torch.float16, device)
    before = layer[0].clone()
    f = inv_freq_for(32).to(device)
    with pytest.raises(ValueError, match="rerotate_keys_.*rows"):
        torch.ops.ragattn.rerotate_keys_(layer, torch.tensor([3, 10], device=device), torch.ones(2, dtype=torch.int32, device=device), f, 32, False)
    with pytest.raises(ValueError, match="copy_kv_.*dst_rows"):
        torch.ops.ragattn.copy_kv_(layer, [], make_layers(1, (4, 2, 32), torch.float16, device), [], torch.tensor([0, 1], device=device), torch.tensor([2, 2], device=device))
    assert torch.equal(layer[0], before)


def test_copy_kv_reference_backend_matches_cpp(device, monkeypatch, seed):
    if device.type != "cpu":
        pytest.skip("CPU backend switch")
    src_k, src_v = make_layers(2, (15, 2, 64), torch.float32, device), make_layers(2, (15, 2, 64), torch.float32, device)
    dst = [make_layers(2, (21, 2, 64), torch.float32, device) for _ in range(2)]
    dst_ref = [[t.clone() for t in d] for d in dst]
    src_rows, dst_rows = torch.randint(0, 15, (11,)), torch.randperm(21)[:11]
    delta, f = rand_delta(11, device), inv_freq_for(64)
    ragattn.copy_kv_(dst[0], dst[1], src_k, src_v, src_rows, dst_rows, delta, f, 64, True)
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", "reference")
    ragattn.copy_kv_(dst_ref[0], dst_ref[1], src_k, src_v, src_rows, dst_rows, delta, f, 64, True)
    for a, b in zip(dst[0] + dst[1], dst_ref[0] + dst_ref[1]):
        assert max_abs_err(a, b) <= 1e-5 * float(b.abs().max())
    with pytest.raises(ValueError, match="copy_kv_: dst_rows"):
        ragattn.copy_kv_(dst_ref[0], dst_ref[1], src_k, src_v, src_rows, torch.zeros(11, dtype=torch.int64))
