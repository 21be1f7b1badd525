"""Benchmarks of ``rerotate_keys_`` and ``copy_kv_``.

gpu: 32 layers x 8 KV heads x 128 dims, bf16, 8192 rows (512 MB of K rows across layers),
plus one 512-token chunk over all layers (latency). Targets (H100): >= 85% of the measured
copy bandwidth, >= 3x over ``torch_two_pass``.

Baselines, per layer in plain torch:
  torch_two_pass         Block-Attention's re-encoding: gather, rotate by -old position then by
                         +new position with cos/sin tables, scatter
  torch_gather_rotate    gather -> rotate once by delta -> scatter (torch indexing)
  torch_index_copy       (copy without rotation) dst[dst_rows] = src[src_rows] for K and V
``bytes`` = useful bytes read + written (rotated dims only for rerotate_keys_).
"""
from __future__ import annotations

import torch

from .harness import Case, Rand, cpu_config, lazy, small_dtype

FAMILIES = ("kv_cache",)  # the Case.family values of this module (lets --only skip building it)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _cos_sin_tables(max_pos, inv_freq, dtype):
    freqs = torch.arange(max_pos, device=inv_freq.device, dtype=torch.float32)[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _delta_cos_sin(delta, inv_freq, dtype):
    freqs = delta.float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def cases(device: torch.device, size: str):
    if size == "gpu":
        shapes = [("N8192", 32, 8, 128, 8192, torch.bfloat16), ("chunk512", 32, 8, 128, 512, torch.bfloat16)]
    else:
        shapes = [("N256", 4, 2, 64, 256, small_dtype(device)), ("chunk32", 4, 2, 64, 32, small_dtype(device))]
    # One builder per shape, its arguments bound now: the lambdas of _shape_cases close over that
    # call's own inputs. (Built inline in a loop, they looked the loop's variables up when called,
    # so every shape ran the last shape's inputs while counting its own bytes.)
    return [lazy("kv_cache", "", _shape_cases, device, Rand(device, seed), *shape) for seed, shape in enumerate(shapes)]


def _kernel_config(device, n: int, layers: int) -> dict:
    """The CUDA launchers' fixed configuration (csrc/kv_cache/kv_cache_kernels.cu): one CTA of 256
    threads per moved row, every layer in that CTA, 16-byte vector accesses when aligned."""
    if device.type != "cuda":
        return dict(cpu_config(), rows=n)
    return {"kernel": "cuda", "threads": 256, "grid": n, "layers_per_cta": layers}


def _shape_cases(device, rnd, tag, L, H, D, N, dtype):
    import ragattn

    out = []
    elem = torch.finfo(dtype).bits // 8
    rows_total = 2 * N  # the request cache holds twice the moved rows
    inv_freq = (1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))).to(device)
    cache_k = [rnd.randn(rows_total, H, D, dtype=dtype) for _ in range(L)]
    cache_v = [rnd.randn(rows_total, H, D, dtype=dtype) for _ in range(L)]
    store_k = [rnd.randn(N, H, D, dtype=dtype) for _ in range(L)]
    store_v = [rnd.randn(N, H, D, dtype=dtype) for _ in range(L)]
    rows = torch.randperm(rows_total, generator=rnd.cpu)[:N].to(device)
    src_rows = torch.arange(N, device=device)
    old_pos = torch.randint(0, 4096, (N,), generator=rnd.cpu).to(device)
    new_pos = old_pos + 4096
    delta = (new_pos - old_pos).int()
    cos_t, sin_t = _cos_sin_tables(8192, inv_freq, dtype)
    params = dict(layers=L, kv_heads=H, head_dim=D, rows=N, dtype=str(dtype).replace("torch.", ""))
    config = lambda: _kernel_config(device, N, L)  # noqa: E731

    def two_pass(dst_k, src_k, s_rows, d_rows):
        c_old, s_old = cos_t[old_pos][:, None], sin_t[old_pos][:, None]
        c_new, s_new = cos_t[new_pos][:, None], sin_t[new_pos][:, None]
        for dk, sk in zip(dst_k, src_k):
            k = sk[s_rows]
            k = k * c_old - _rotate_half(k) * s_old  # un-rotate
            k = k * c_new + _rotate_half(k) * s_new  # re-rotate
            dk[d_rows] = k

    def gather_rotate(dst_k, src_k, s_rows, d_rows):
        c, s = _delta_cos_sin(delta, inv_freq, dtype)
        for dk, sk in zip(dst_k, src_k):
            k = sk[s_rows]
            dk[d_rows] = k * c + _rotate_half(k) * s

    def copy_torch():
        for dk, sk, dv, sv in zip(cache_k, store_k, cache_v, store_v):
            dk[rows] = sk[src_rows]
            dv[rows] = sv[src_rows]

    out.append(Case(
        family="kv_cache", name=f"rerotate_keys_ {tag}",
        run=lambda: ragattn.rerotate_keys_(cache_k, rows, delta, inv_freq, D, False),
        baselines={
            "torch_two_pass": lambda: two_pass(cache_k, cache_k, rows, rows),
            "torch_gather_rotate": lambda: gather_rotate(cache_k, cache_k, rows, rows),
        },
        bytes=2 * N * L * H * D * elem, peak="copy", params=params, config=config,
    ))
    out.append(Case(
        family="kv_cache", name=f"copy_kv_ {tag}",
        run=lambda: ragattn.copy_kv_(cache_k, cache_v, store_k, store_v, src_rows, rows),
        baselines={"torch_index_copy": copy_torch},
        bytes=2 * 2 * N * L * H * D * elem, peak="copy", params=params, config=config,
    ))

    def fused_two_pass():
        two_pass(cache_k, store_k, src_rows, rows)
        for dv, sv in zip(cache_v, store_v):
            dv[rows] = sv[src_rows]

    def fused_gather_rotate():
        gather_rotate(cache_k, store_k, src_rows, rows)
        for dv, sv in zip(cache_v, store_v):
            dv[rows] = sv[src_rows]

    out.append(Case(
        family="kv_cache", name=f"copy_kv_+rotate {tag}",
        run=lambda: ragattn.copy_kv_(cache_k, cache_v, store_k, store_v, src_rows, rows, delta, inv_freq, D, False),
        baselines={"torch_two_pass": fused_two_pass, "torch_gather_rotate": fused_gather_rotate},
        bytes=2 * 2 * N * L * H * D * elem, peak="copy", params=params, config=config,
    ))

    # fp8 caches (vLLM's kv_cache_dtype="fp8"): the same moves on float8_e4m3fn with per-layer
    # scales, against torch's dequantise -> rotate -> requantise
    fp8 = torch.float8_e4m3fn
    scale = torch.full((L,), 0.05, device=device)
    k8 = [(t.float() / 0.05).clamp(-448, 448).to(fp8) for t in cache_k]
    v8 = [(t.float() / 0.05).clamp(-448, 448).to(fp8) for t in cache_v]
    sk8 = [(t.float() / 0.05).clamp(-448, 448).to(fp8) for t in store_k]
    sv8 = [(t.float() / 0.05).clamp(-448, 448).to(fp8) for t in store_v]
    p8 = dict(params, dtype="float8_e4m3fn")

    def torch_fp8_rotate(dst, src, s_rows, d_rows):
        c, s = _delta_cos_sin(delta, inv_freq, torch.float32)
        for dk, sk in zip(dst, src):
            k = sk[s_rows].float() * 0.05
            dk[d_rows] = ((k * c + _rotate_half(k) * s) / 0.05).clamp(-448, 448).to(fp8)

    def torch_fp8_copy_rotate():
        torch_fp8_rotate(k8, sk8, src_rows, rows)
        for dv, sv in zip(v8, sv8):
            dv[rows] = sv[src_rows]

    out.append(Case(
        family="kv_cache", name=f"rerotate_keys_ fp8 {tag}",
        run=lambda: ragattn.rerotate_keys_(k8, rows, delta, inv_freq, D, False, k_scale=scale),
        baselines={"torch_dequant_rotate": lambda: torch_fp8_rotate(k8, k8, rows, rows)},
        bytes=2 * N * L * H * D, peak="copy", params=p8, config=config,
    ))
    out.append(Case(
        family="kv_cache", name=f"copy_kv_+rotate fp8 {tag}",
        run=lambda: ragattn.copy_kv_(k8, v8, sk8, sv8, src_rows, rows, delta, inv_freq, D, False,
                                     src_k_scale=scale, src_v_scale=scale, dst_k_scale=scale, dst_v_scale=scale),
        baselines={"torch_dequant_rotate": torch_fp8_copy_rotate},
        bytes=2 * 2 * N * L * H * D, peak="copy", params=p8, config=config,
    ))
    return out
