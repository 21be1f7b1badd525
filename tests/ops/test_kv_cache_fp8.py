"""Float8_e4m3fn KV caches (vLLM's kv_cache_dtype="fp8", per-tensor k/v scales) in
rerotate_keys_ and copy_kv_, against the dequantised float64 reference: the kernel may differ from
the exact rotation of the dequantised keys by the fp8 rounding of the result (half a unit in the
last place of e4m3, 2^-4 relative) and fp32 noise, never more; unrotated copies are exact."""
from __future__ import annotations

import pytest
import torch

import ragattn
from ragattn.reference import kv_cache as ref
from tests.helpers import randn_nonzero, use_kernel_backend

FP8 = torch.float8_e4m3fn
BACKENDS = ["default", "reference"]


def inv_freq_for(rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def fp8_layers(n, shape, scale, device, gen):
    """fp8 caches whose dequantised values are ~N(0, 1) * 3 (every exponent of e4m3 in use)."""
    out = []
    for l in range(n):
        x = torch.randn(*shape, generator=gen) * 3
        out.append(ref.quantize(x, scale[l] if scale.numel() > 1 else scale, FP8).to(device))
    return out


def deq(t, s):
    return t.to(torch.float64) * float(s)


def assert_fp8_close(got, want64, scale, what):
    """got (fp8) dequantised vs the exact float64 values: within one e4m3 rounding (|x| 2^-4, or the
    subnormal step 2^-9 * scale) plus fp32 noise, and the saturation bound 448 * scale."""
    g = deq(got, scale)
    w = want64.clamp(-448 * float(scale), 448 * float(scale))
    tol = torch.maximum(w.abs() * 2.0 ** -4, torch.full_like(w, 2.0 ** -9 * float(scale))) * 1.001 + 1e-6
    bad = (g - w).abs() > tol
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} elements off, max err {(g - w).abs().max():.3e}"


def scales_for(n, device, per_layer):
    s = torch.tensor([0.37, 1.9, 0.05, 4.2][:n] if per_layer else [0.61], dtype=torch.float32)
    return s.to(device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("per_layer", [False, True])
def test_rerotate_fp8(device, monkeypatch, backend, interleaved, per_layer):
    use_kernel_backend(monkeypatch, device, backend)
    gen = torch.Generator().manual_seed(3)
    L, rotary = 3, 48  # partial rotary of head_dim 64
    scale = scales_for(L, device, per_layer)
    layers = fp8_layers(L, (9, 7, 3, 64), scale, device, gen)  # paged [pages, page_size, H, D]
    before = [t.clone() for t in layers]
    rows = torch.randperm(63, generator=gen)[:29].to(device)
    delta = torch.randint(-(1 << 20), 1 << 20, (29,), generator=gen).to(device)
    f = inv_freq_for(rotary).to(device)
    ragattn.rerotate_keys_(layers, rows, delta, f, rotary, interleaved, k_scale=scale)
    for l, (got, x) in enumerate(zip(layers, before)):
        s = scale[l] if per_layer else scale[0]
        gv, xv = got.view(-1, 3, 64), x.view(-1, 3, 64)
        want = ref.rope_rotate(deq(xv[rows], s), delta, f, rotary, interleaved)
        assert_fp8_close(gv[rows], want, s, f"layer {l}")
        # unrotated dims and untouched rows keep their bytes
        assert torch.equal(gv[rows][..., rotary:].view(torch.uint8), xv[rows][..., rotary:].view(torch.uint8))
        keep = torch.ones(63, dtype=torch.bool, device=device)
        keep[rows] = False
        assert torch.equal(gv[keep].view(torch.uint8), xv[keep].view(torch.uint8))


def test_rerotate_fp8_round_trip_and_saturation(device):
    """Rotating by d then -d returns within two fp8 roundings; values pushed past 448 * scale
    saturate to the largest finite e4m3 (never NaN, as vLLM quantises)."""
    gen = torch.Generator().manual_seed(4)
    scale = torch.tensor([0.5], device=device)
    layer = fp8_layers(1, (20, 2, 32), scale, device, gen)[0]
    x0 = layer.clone()
    rows = torch.arange(20, device=device)
    d = torch.randint(1, 5000, (20,), generator=gen).to(device)
    f = inv_freq_for(32).to(device)
    ragattn.rerotate_keys_([layer], rows, d, f, 32, False, k_scale=scale)
    ragattn.rerotate_keys_([layer], rows, -d, f, 32, False, k_scale=scale)
    x = deq(x0, 0.5)
    err = (deq(layer, 0.5) - x).abs()
    pair_norm = torch.sqrt(x[..., :16] ** 2 + x[..., 16:] ** 2).repeat(1, 1, 2)  # NeoX pairs (i, i + 16)
    assert bool((err <= pair_norm * 2.0 ** -3 + 2.0 ** -8).all())  # two roundings of the pair's scale
    big = ref.quantize(torch.full((1, 2, 32), 440.0 * 0.5), scale, FP8).to(device)  # near the top
    big.view(-1)[1::2] = ref.quantize(torch.full((32,), -440.0 * 0.5), scale, FP8).to(device)
    ragattn.rerotate_keys_([big], torch.tensor([0], device=device), torch.tensor([1], device=device), f, 32, False,
                           k_scale=scale)
    assert not bool(torch.isnan(big.float()).any())
    assert float(big.float().abs().max()) == 448.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pair", ["fp8->fp8", "fp8->bf16", "bf16->fp8", "fp8->fp32"])
@pytest.mark.parametrize("rotate", [False, True])
def test_copy_kv_fp8(device, monkeypatch, backend, pair, rotate):
    use_kernel_backend(monkeypatch, device, backend)
    gen = torch.Generator().manual_seed(5)
    L, H, D = 2, 2, 64
    src_dt, dst_dt = [{"fp8": FP8, "bf16": torch.bfloat16, "fp32": torch.float32}[p] for p in pair.split("->")]
    ss, ds = scales_for(L, device, True), scales_for(L, device, False) * 3

    def make(n, dt, scale):
        if dt == FP8:
            return fp8_layers(L, (n, H, D), scale, device, gen), fp8_layers(L, (n, H, D), scale, device, gen)
        return ([randn_nonzero(n, H, D, dtype=dt, device=device, generator=gen) for _ in range(L)],
                [randn_nonzero(n, H, D, dtype=dt, device=device, generator=gen) for _ in range(L)])

    sk, sv = make(23, src_dt, ss)
    dk, dv = make(37, dst_dt, ds)
    dk0, dv0 = [t.clone() for t in dk], [t.clone() for t in dv]
    src_rows = torch.randint(0, 23, (19,), generator=gen).to(device)  # may repeat
    dst_rows = torch.randperm(37, generator=gen)[:19].to(device)
    delta = torch.randint(-4096, 4096, (19,), generator=gen).to(device) if rotate else None
    f = inv_freq_for(D).to(device)
    sc = {}
    if src_dt == FP8:
        sc.update(src_k_scale=ss, src_v_scale=ss)
    if dst_dt == FP8:
        sc.update(dst_k_scale=ds, dst_v_scale=ds)
    ragattn.copy_kv_(dk, dv, sk, sv, src_rows, dst_rows, delta, f if rotate else None, D if rotate else 0, False, **sc)
    for l in range(L):
        s_in = float(ss[l]) if src_dt == FP8 else 1.0
        s_out = float(ds[0]) if dst_dt == FP8 else 1.0
        for got, src, old, rot in ((dk[l], sk[l], dk0[l], rotate), (dv[l], sv[l], dv0[l], False)):
            want = deq(src[src_rows], s_in)
            if rot:
                want = ref.rope_rotate(want, delta, f, D, False)
            g = got[dst_rows]
            if dst_dt == FP8:
                assert_fp8_close(g, want, s_out, f"{pair} layer {l}")
            else:
                tol = 2.0 ** -7 if dst_dt == torch.bfloat16 else 1e-5
                assert float((g.double() - want).abs().max()) <= tol * float(want.abs().max()) * 2
            if not rot and src_dt == dst_dt:  # fp8 -> fp8 unrotated, scales differ: one requantisation
                pass
            keep = torch.ones(37, dtype=torch.bool, device=device)
            keep[dst_rows] = False
            assert torch.equal(got[keep].view(torch.uint8), old[keep].view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_fp8_same_scale_is_a_byte_copy(device, monkeypatch, backend):
    """fp8 -> fp8 without rotation and with equal scales copies the bytes (requantising with the
    same scale is the identity), NaN included."""
    use_kernel_backend(monkeypatch, device, backend)
    gen = torch.Generator().manual_seed(6)
    s = torch.tensor([0.73], device=device)
    src = fp8_layers(2, (11, 2, 32), s, device, gen)
    src[0].view(torch.uint8)[3, 1, 5] = 0x7F  # NaN
    dst = fp8_layers(2, (11, 2, 32), s, device, gen)
    rows = torch.arange(11, device=device)
    ragattn.copy_kv_(dst, [], src, [], rows, rows.flip(0), src_k_scale=s, dst_k_scale=s)
    for d, x in zip(dst, src):
        assert torch.equal(d.view(torch.uint8), x.flip(0).view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_fp8_aliased_matches_unaliased(device, monkeypatch, backend):
    """An in-place move inside one fp8 cache (staged through float32) rounds once, like the copy
    between two caches."""
    use_kernel_backend(monkeypatch, device, backend)
    gen = torch.Generator().manual_seed(7)
    s = torch.tensor([1.3], device=device)
    cache = fp8_layers(1, (30, 2, 32), s, device, gen)[0]
    other = cache.clone()
    src_rows, dst_rows = torch.arange(0, 12, device=device), torch.arange(6, 18, device=device)
    delta = torch.full((12,), 37, device=device)
    f = inv_freq_for(32).to(device)
    ragattn.copy_kv_([cache], [], [cache], [], src_rows, dst_rows, delta, f, 32, False, src_k_scale=s, dst_k_scale=s)
    ragattn.copy_kv_([other], [], [other.clone()], [], src_rows, dst_rows, delta, f, 32, False, src_k_scale=s,
                     dst_k_scale=s)
    assert torch.equal(cache.view(torch.uint8), other.view(torch.uint8))


def test_fp8_cpu_twin_matches_reference_bits(device):
    """The C++ twin and the float32 reference round alike almost everywhere: they share the
    dequantise / fp32 rotate / saturate-and-round rule (cos/sin may differ in the last fp32 bit)."""
    if device.type != "cpu":
        pytest.skip("compares the CPU twin with the CPU reference")
    gen = torch.Generator().manual_seed(8)
    s = torch.tensor([0.9])
    a = fp8_layers(2, (40, 2, 64), s, device, gen)
    b = [t.clone() for t in a]
    rows, delta, f = torch.arange(40), torch.randint(-999, 999, (40,), generator=gen), inv_freq_for(64)
    ragattn.rerotate_keys_(a, rows, delta, f, 64, False, k_scale=s)
    ref.rerotate_keys_(b, rows, delta, f, 64, False, compute_dtype=torch.float32, k_scale=s)
    diff = sum(int((x.view(torch.uint8) != y.view(torch.uint8)).sum()) for x, y in zip(a, b))
    assert diff <= 0.002 * 2 * 40 * 2 * 64, diff


@pytest.mark.parametrize("entry", ["wrapper", "op", "meta"])
def test_fp8_scale_errors(device, entry):
    dev = "meta" if entry == "meta" else device
    fn_r = ragattn.rerotate_keys_ if entry == "wrapper" else torch.ops.ragattn.rerotate_keys_
    fn_c = ragattn.copy_kv_ if entry == "wrapper" else torch.ops.ragattn.copy_kv_
    layer = torch.zeros(8, 2, 32, dtype=FP8, device=dev)
    bf = torch.ones(8, 2, 32, dtype=torch.bfloat16, device=dev)
    f = inv_freq_for(32).to(dev)
    rows, d = torch.tensor([1, 2], device=dev), torch.tensor([3, 4], device=dev)
    with pytest.raises(ValueError, match=r"rerotate_keys_: k_scale is required: k_layers is float8_e4m3fn"):
        fn_r([layer], rows, d, f, 32, False)
    with pytest.raises(ValueError, match=r"rerotate_keys_: k_scale must have shape \[\], \[1\] or \[num_layers\] = \[1\]"):
        fn_r([layer], rows, d, f, 32, False, k_scale=torch.ones(3, device=dev))
    with pytest.raises(TypeError, match=r"rerotate_keys_: k_scale must be float32"):
        fn_r([layer], rows, d, f, 32, False, k_scale=torch.ones(1, dtype=torch.float16, device=dev))
    with pytest.raises(ValueError, match=r"rerotate_keys_: k_scale is given but k_layers is (bfloat16|BFloat16)"):
        fn_r([bf], rows, d, f, 32, False, k_scale=torch.ones(1, device=dev))
    with pytest.raises(ValueError, match=r"copy_kv_: dst_k_scale is required"):
        fn_c([layer], [], [bf], [], rows, rows)
    with pytest.raises(TypeError, match=r"copy_kv_: src_k must have dst_k's dtype"):
        fn_c([bf], [], [bf.half()], [], rows, rows)
    with pytest.raises(ValueError, match=r"copy_kv_: dst_v_scale/src_v_scale are given but no V layers"):
        fn_c([layer], [], [bf], [], rows, rows, dst_k_scale=torch.ones(1, device=dev),
             dst_v_scale=torch.ones(1, device=dev))


# opcheck's schema test compares the mutated fp8 caches with allclose, which torch does not implement
# for float8 on the CPU: the other checks run, the schema's mutation is covered by the bf16 opchecks.
_FP8_OPCHECKS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def test_fp8_opcheck(device):
    gen = torch.Generator().manual_seed(9)
    s = torch.tensor([0.8, 1.1], device=device)
    layers = fp8_layers(2, (12, 2, 32), s, device, gen)
    rows, delta = torch.tensor([3, 0, 11], device=device), torch.tensor([7, -3, 100], device=device)
    f = inv_freq_for(32).to(device)
    torch.library.opcheck(torch.ops.ragattn.rerotate_keys_.default, (layers, rows, delta, f, 32, False),
                          {"k_scale": s}, test_utils=_FP8_OPCHECKS)
    dk = [torch.zeros(10, 2, 32, dtype=torch.bfloat16, device=device) + 1 for _ in range(2)]
    dst = torch.tensor([9, 2, 4], device=device)
    torch.library.opcheck(torch.ops.ragattn.copy_kv_.default, (dk, [], layers, [], rows, dst, delta, f, 32, True),
                          {"src_k_scale": s}, test_utils=_FP8_OPCHECKS)
    torch.library.opcheck(torch.ops.ragattn.copy_kv_.default, (layers, [], dk, [], dst, rows),
                          {"dst_k_scale": s}, test_utils=_FP8_OPCHECKS)


def test_fp8_inference_mode(device):
    gen = torch.Generator().manual_seed(10)
    s = torch.tensor([0.8], device=device)
    with torch.inference_mode():
        layers = fp8_layers(1, (12, 2, 32), s, device, gen)
        ragattn.rerotate_keys_(layers, torch.tensor([1, 2], device=device), torch.tensor([5, 6], device=device),
                               inv_freq_for(32).to(device), 32, False, k_scale=s)


BAD_SCALES = [0.0, -1.0, float("nan"), float("inf")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", ["wrapper", "op"])
@pytest.mark.parametrize("bad", BAD_SCALES)
def test_fp8_scale_must_be_finite_and_positive(device, monkeypatch, backend, entry, bad):
    """A scale of 0, a negative, NaN or inf is refused before any write (rerotate_keys_ wrote NaN
    into the cache, copy_kv_ +-448), per layer too; on CUDA it is a precondition checked under
    RAGATTN_DEBUG=1 (reading it elsewhere would sync), so this runs where values are read."""
    if device != "cpu":
        monkeypatch.setenv("RAGATTN_DEBUG", "1")
    use_kernel_backend(monkeypatch, device, backend)
    fn_r = ragattn.rerotate_keys_ if entry == "wrapper" else torch.ops.ragattn.rerotate_keys_
    fn_c = ragattn.copy_kv_ if entry == "wrapper" else torch.ops.ragattn.copy_kv_
    gen = torch.Generator().manual_seed(12)
    good = torch.tensor([0.5, 0.7], device=device)
    s = torch.tensor([0.5, bad], device=device)                  # the second layer's scale is bad
    layers = fp8_layers(2, (8, 2, 32), good, device, gen)
    before = [t.clone() for t in layers]
    rows, d = torch.tensor([1, 2], device=device), torch.tensor([3, 4], device=device)
    f = inv_freq_for(32).to(device)
    with pytest.raises(ValueError, match=r"rerotate_keys_: k_scale must be finite and > 0 .* at index 1"):
        fn_r(layers, rows, d, f, 32, False, k_scale=s)
    bf = [torch.randn(8, 2, 32, generator=gen).to(device, torch.bfloat16) for _ in range(2)]
    with pytest.raises(ValueError, match=r"copy_kv_: dst_k_scale must be finite and > 0"):
        fn_c(layers, [], bf, [], rows, rows, dst_k_scale=s)
    with pytest.raises(ValueError, match=r"copy_kv_: src_k_scale must be finite and > 0"):
        fn_c(bf, [], layers, [], rows, rows, src_k_scale=s)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(layers, before))


def test_fp8_scale_values_are_not_read_by_the_fake():
    """Meta tensors have no values: the fake checks what it can (shape, dtype, device) and lets
    the value rule to the real impl, as it does for row ranges."""
    layer = torch.zeros(8, 2, 32, dtype=FP8, device="meta")
    rows = torch.tensor([1, 2], device="meta")
    torch.ops.ragattn.rerotate_keys_([layer], rows, rows, inv_freq_for(32).to("meta"), 32, False,
                                     k_scale=torch.zeros(1, device="meta"))
