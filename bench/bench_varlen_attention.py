"""Benchmarks of ``varlen_attention``.

gpu (bf16, 32 query heads, 8 kv heads, head dim 128, causal), Block-Attention's mask (chunks
independent, final block global):
* ``chunks500``: 64 chunks of 500 tokens + a 50-token global tail (32,050 tokens). Targets:
  >= 1.5x faster than FlexAttention on the same mask, >= 30x faster than full causal SDPA.
* ``chunks4096``: 8 chunks of 4,096 tokens + the 50-token tail. Target: >= 50% of the measured
  bf16 matmul peak in useful TFLOP/s.
* ``chunks500_bwd``: the backward of ``chunks500`` (dq, dk, dv from saved out/lse). Target:
  >= 1.2x faster than FlexAttention's backward (timed with ``retain_graph``, forward excluded;
  FlexAttention has no CPU backward, so on the CPU only the dense-mask SDPA backward runs).
Baselines in the same case: SDPA with a dense boolean mask (memory-efficient backend, K/V
repeated to 32 heads), FlexAttention (compiled on CUDA) with the equivalent ``BlockMask``
(creation time in ``setup_ms``) and SDPA full causal (flash backend). ``flops`` counts the
visible (query, key) pairs only: 4 * head_dim * heads per pair forward, 2.5x that backward.
* ``window``: a Mistral-style sliding window (``window_left = 4095``, 16,384 tokens causal)
  against SDPA with the dense band mask and FlexAttention with a window ``mask_mod`` (compiled on
  CUDA). Target: >= 1.2x FlexAttention.
FlexAttention is compiled with ``fullgraph=True`` on CUDA (``compiled_flex``), and the backward
baseline checks that its forward ran a compiled graph, so the backward it times is the compiled one.
cpu: the same cases on ~90 tokens (ragattn runs its CPU path; FlexAttention runs eagerly,
uncompiled, so its CPU time says nothing about its GPU speed).
"""
from __future__ import annotations

import contextlib
import time

import torch

from .harness import Case, Rand, cpu_config, lazy, small_dtype, synchronize

FAMILIES = ("varlen_attention",)  # the Case.family values of this module (lets --only skip building it)

I32 = torch.int32


def _flash_only(device):
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _shape(size, chunk, device):
    if size == "gpu":
        n_chunks = 64 if chunk == 500 else 8
        return dict(n_chunks=n_chunks, chunk=chunk, tail=50, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    return dict(n_chunks=4, chunk=20 if chunk == 500 else 40, tail=6, heads=4, kv_heads=2, head_dim=64, dtype=small_dtype(device))


def _problem(device, size, chunk, rnd):
    """Packed inputs of one sequence: chunk blocks 0..n-1, then the global tail (block -1)."""
    s = _shape(size, chunk, device)
    n, c, tail, H, Hkv, D, dtype = (s[k] for k in ("n_chunks", "chunk", "tail", "heads", "kv_heads", "head_dim", "dtype"))
    L = n * c + tail
    blk = torch.cat([torch.arange(n).repeat_interleave(c), torch.full((tail,), -1)]).to(I32)
    q = rnd.randn(L, H, D, dtype=dtype)
    k = rnd.randn(L, Hkv, D, dtype=dtype)
    v = rnd.randn(L, Hkv, D, dtype=dtype)
    cu = torch.tensor([0, L], dtype=I32, device=device)
    pairs = n * c * (c + 1) / 2 + sum(n * c + i + 1 for i in range(tail))  # visible (q, k) pairs
    return dict(q=q, k=k, v=v, cu=cu, blk=blk.to(device), L=L, H=H, Hkv=Hkv, D=D, dtype=dtype, pairs=pairs, name=f"{n}x{c}+{tail}_h{H}_kv{Hkv}_d{D}")


def _config(device, head_dim, dtype, kernels, window=False):
    """``Case.config`` of a varlen case: each Triton kernel's tiles, warps and stages from the table
    (and which entry), or the CPU backend."""
    def config():
        if device.type != "cuda":
            return cpu_config()
        from ragattn.triton_kernels import varlen_attention as va
        from ragattn.triton_kernels.gpu_configs import lookup

        out = {}
        for kernel in kernels:
            c, where = lookup("varlen_attention", torch.cuda.get_device_name(device),
                              va.config_key(head_dim, kernel, dtype, window))
            out[kernel] = f"{c['BLOCK_M']}x{c['BLOCK_N']}/w{c['num_warps']}/s{c['num_stages']}"
            out["table"] = where.split(":")[0]
        return out

    return config


def _runnable(baselines, device):
    """Drop (and say so) the baselines that cannot run here, e.g. out of memory or no backend."""
    for name in list(baselines):
        try:
            baselines[name]()
            synchronize(device)
        except Exception as exc:  # pragma: no cover - depends on the device and torch build
            print(f"bench_varlen_attention: baseline {name} skipped ({type(exc).__name__}: {str(exc)[:200]})")
            del baselines[name]
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return baselines


def _efficient_only(device):
    """The dense-mask baseline must not fall back to the math backend ([H, L, L] scores: OOM)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)


def compiled_flex(device):
    """FlexAttention as the GPU runs it: ``torch.compile``d with ``fullgraph=True``, so that a graph
    break is an error instead of a silent eager fallback (eager FlexAttention materialises the whole
    score matrix: a backward baseline as slow as the dense-mask backward did not run the compiled
    kernels). The CPU runs it eagerly (its times say nothing)."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        def eager_flex(*args, **kwargs):
            with warnings.catch_warnings():  # eager on purpose here: torch's advice to compile is known
                warnings.filterwarnings("ignore", "flex_attention called without torch.compile", UserWarning)
                return flex_attention(*args, **kwargs)

        return eager_flex
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


def require_compiled_graph(out: torch.Tensor) -> None:
    """RuntimeError unless ``out`` came out of a compiled autograd graph (``torch.compile`` gives it
    a ``CompiledFunctionBackward`` grad_fn, whose backward is the compiled one); eager FlexAttention
    gives ``FlexAttentionAutogradOpBackward`` or similar."""
    name = out.grad_fn.name() if out.grad_fn is not None else "None"
    if "Compiled" not in name:
        raise RuntimeError(f"the FlexAttention forward did not run a compiled graph (its grad_fn is {name})")


def _flex_baseline(mask_mod, qkv, L, device, backward: bool):
    """(callable, BlockMask creation ms) of FlexAttention with ``mask_mod`` over ``qkv`` (``[1, H, L, D]``
    and ``[1, Hkv, L, D]``). ``backward``: the callable is the backward alone (dq, dk, dv through the
    compiled graph's saved tensors, ``retain_graph``), the forward having run once here; on CUDA
    both the forward and its backward must come from the compiled graph (RuntimeError if not)."""
    from torch.nn.attention.flex_attention import create_block_mask

    t0 = time.perf_counter()
    block_mask = create_block_mask(mask_mod, None, None, L, L, device=str(device))
    synchronize(device)
    setup_ms = (time.perf_counter() - t0) * 1e3
    flex = compiled_flex(device)
    q4, k4, v4 = qkv
    if not backward:
        return (lambda: flex(q4, k4, v4, block_mask=block_mask, enable_gqa=True)), setup_ms
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q4, k4, v4))
    out = flex(qg, kg, vg, block_mask=block_mask, enable_gqa=True)
    if device.type == "cuda":
        require_compiled_graph(out)
    dout = torch.randn_like(out)
    return (lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)), setup_ms


def baseline_backends(device) -> dict:
    """How each baseline of this module runs (recorded in every row: ``Case.backends``)."""
    flex = ("torch.compile(flex_attention, fullgraph=True, dynamic=False), BlockMask from create_block_mask"
            if device.type == "cuda" else "flex_attention eager (CPU: its time says nothing of the GPU)")
    return {"flex_attention": flex, "flex_attention_bwd": flex + "; backward of the compiled graph",
            "flex_attention_window": flex,
            "sdpa_dense_mask": "SDPA, memory-efficient backend only, K/V repeated to every head",
            "sdpa_dense_mask_bwd": "SDPA, memory-efficient backend only, K/V repeated to every head",
            "sdpa_dense_band_mask": "SDPA, memory-efficient backend only, K/V repeated to every head",
            "sdpa_full_causal": "SDPA, flash backend only, K/V repeated to every head",
            "ragattn_no_cap": "ragattn, the same call without logits_soft_cap"}


def _baselines(p, device, backward: bool):
    """(baselines dict, setup_ms dict) computing the same attention (or its backward)."""
    q4 = p["q"].transpose(0, 1).unsqueeze(0).contiguous()  # [1, H, L, D]
    k4 = p["k"].transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hkv, L, D]
    v4 = p["v"].transpose(0, 1).unsqueeze(0).contiguous()
    group = p["H"] // p["Hkv"]
    kr, vr = k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1)
    blk, L = p["blk"], p["L"]
    baselines, setup = {}, {}

    def mask_mod(b, h, q_idx, kv_idx):
        qb, kb = blk[q_idx], blk[kv_idx]
        return (kv_idx <= q_idx) & ((qb == kb) | (qb == -1) | (kb == -1))

    # FlexAttention with the equivalent BlockMask
    try:
        flex_setup = _flex_baseline(mask_mod, (q4, k4, v4), L, device, backward)
    except Exception as exc:  # pragma: no cover - FlexAttention missing or unsupported here
        print(f"bench_varlen_attention: FlexAttention baseline skipped ({type(exc).__name__}: {exc})")
    else:
        name = "flex_attention_bwd" if backward else "flex_attention"
        baselines[name], setup[name] = flex_setup

    # SDPA with a dense boolean mask (what a generic engine materialises)
    t0 = time.perf_counter()
    pos = torch.arange(L, device=device)
    qb, kb = blk[:, None], blk[None, :]
    dense = (pos[None, :] <= pos[:, None]) & ((qb == kb) | (qb == -1) | (kb == -1))
    synchronize(device)
    mask_ms = (time.perf_counter() - t0) * 1e3
    if backward:
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q4, kr, vr))
        try:
            with _efficient_only(device):
                out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, attn_mask=dense)
            dout = torch.randn_like(out)
            baselines["sdpa_dense_mask_bwd"] = lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)
            setup["sdpa_dense_mask_bwd"] = mask_ms
        except Exception as exc:  # pragma: no cover
            print(f"bench_varlen_attention: baseline sdpa_dense_mask_bwd skipped ({type(exc).__name__}: {str(exc)[:200]})")
        return _runnable(baselines, device), setup
    setup["sdpa_dense_mask"] = mask_ms

    def dense_mask():
        with _efficient_only(device):
            return torch.nn.functional.scaled_dot_product_attention(q4, kr, vr, attn_mask=dense)

    baselines["sdpa_dense_mask"] = dense_mask

    def full_causal():
        with _flash_only(device):
            return torch.nn.functional.scaled_dot_product_attention(q4, kr, vr, is_causal=True)

    baselines["sdpa_full_causal"] = full_causal
    return _runnable(baselines, device), setup


def _forward_case(device, size, chunk, rnd):
    import ragattn

    p = _problem(device, size, chunk, rnd)
    baselines, setup = _baselines(p, device, backward=False)
    target = ">= 1.5x flex, >= 30x sdpa_full_causal" if chunk == 500 else ">= 50% of matmul peak"
    return Case(
        family="varlen_attention",
        name=f"chunks{p['name']}",
        run=lambda: ragattn.varlen_attention(p["q"], p["k"], p["v"], p["cu"], p["cu"], q_block=p["blk"], kv_block=p["blk"]),
        baselines=baselines,
        flops=4.0 * p["D"] * p["H"] * p["pairs"],
        peak="matmul",
        peak_dtype=p["dtype"],
        setup_ms=setup,
        backends=baseline_backends(device),
        params={"dtype": str(p["dtype"]).replace("torch.", ""), "tokens": p["L"], "target": target},
        config=_config(device, p["D"], p["dtype"], ("fwd",)),
    )


def _backward_case(device, size, rnd):
    import ragattn

    p = _problem(device, size, 500, rnd)
    q, k, v, cu, blk = p["q"], p["k"], p["v"], p["cu"], p["blk"]
    out, lse = ragattn.varlen_attention(q, k, v, cu, cu, q_block=blk, kv_block=blk)
    dout = rnd.randn(*out.shape, dtype=out.dtype)
    baselines, setup = _baselines(p, device, backward=True)
    return Case(
        family="varlen_attention",
        name=f"bwd_chunks{p['name']}",
        run=lambda: torch.ops.ragattn.varlen_attention_backward(dout, q, k, v, out, lse, cu, cu, None, None, blk, blk, True, None),
        baselines=baselines,
        flops=2.5 * 4.0 * p["D"] * p["H"] * p["pairs"],
        peak="matmul",
        peak_dtype=p["dtype"],
        setup_ms=setup,
        backends=baseline_backends(device),
        params={"dtype": str(p["dtype"]).replace("torch.", ""), "tokens": p["L"], "target": ">= 1.2x flex backward"},
        config=_config(device, p["D"], p["dtype"], ("dq", "dkdv")),
    )


def _window_case(device, size, rnd):
    """Mistral-style sliding window: one causal sequence, each query sees the last ``window_left + 1``
    keys. Baseline: SDPA with the dense band mask (K/V repeated), the generic engine's fallback."""
    import ragattn

    if size == "gpu":
        L, H, Hkv, D, W, dtype = 16384, 32, 8, 128, 4095, torch.bfloat16
    else:
        L, H, Hkv, D, W, dtype = 96, 4, 2, 64, 31, small_dtype(device)
    q = rnd.randn(L, H, D, dtype=dtype)
    k = rnd.randn(L, Hkv, D, dtype=dtype)
    v = rnd.randn(L, Hkv, D, dtype=dtype)
    cu = torch.tensor([0, L], dtype=I32, device=device)
    pairs = sum(min(i + 1, W + 1) for i in range(L))
    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()
    kr, vr = (t.transpose(0, 1).unsqueeze(0).repeat_interleave(H // Hkv, 1).contiguous() for t in (k, v))
    i = torch.arange(L, device=device)
    band = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - W)

    def dense_band():
        with _efficient_only(device):
            return torch.nn.functional.scaled_dot_product_attention(q4, kr, vr, attn_mask=band)

    def window_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= W)

    baselines = {"sdpa_dense_band_mask": dense_band}
    setup = {}
    try:
        k4, v4 = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (k, v))
        baselines["flex_attention_window"], setup["flex_attention_window"] = _flex_baseline(
            window_mod, (q4, k4, v4), L, device, backward=False)
    except Exception as exc:  # pragma: no cover - FlexAttention missing or unsupported here
        print(f"bench_varlen_attention: FlexAttention window baseline skipped ({type(exc).__name__}: {exc})")

    return Case(
        family="varlen_attention",
        name=f"window{W + 1}_L{L}_h{H}_kv{Hkv}_d{D}",
        run=lambda: ragattn.varlen_attention(q, k, v, cu, cu, window_left=W),
        baselines=_runnable(baselines, device),
        setup_ms=setup,
        backends=baseline_backends(device),
        flops=4.0 * D * H * pairs,
        peak="matmul",
        peak_dtype=dtype,
        params={"dtype": str(dtype).replace("torch.", ""), "tokens": L, "window_left": W,
                "target": ">= 1.2x flex_attention_window"},
        config=_config(device, D, dtype, ("fwd",), window=True),
    )


def _soft_cap_case(device, size, rnd):
    """Gemma 2's layer: soft-capped scores (``logits_soft_cap=50``), head_dim 256, one causal
    sequence. Baseline: the same call without the cap (what the cap costs: one tanh per score)."""
    import ragattn

    if size == "gpu":
        L, H, Hkv, D, dtype = 8192, 16, 8, 256, torch.bfloat16
    else:
        L, H, Hkv, D, dtype = 96, 4, 2, 256, small_dtype(device)
    q = rnd.randn(L, H, D, dtype=dtype)
    k = rnd.randn(L, Hkv, D, dtype=dtype)
    v = rnd.randn(L, Hkv, D, dtype=dtype)
    cu = torch.tensor([0, L], dtype=I32, device=device)
    return Case(
        family="varlen_attention",
        name=f"softcap50_L{L}_h{H}_kv{Hkv}_d{D}",
        run=lambda: ragattn.varlen_attention(q, k, v, cu, cu, logits_soft_cap=50.0),
        baselines={"ragattn_no_cap": lambda: ragattn.varlen_attention(q, k, v, cu, cu)},
        backends=baseline_backends(device),
        flops=4.0 * D * H * L * (L + 1) / 2,
        peak="matmul",
        peak_dtype=dtype,
        params={"dtype": str(dtype).replace("torch.", ""), "tokens": L, "logits_soft_cap": 50.0},
    )


def cases(device: torch.device, size: str):
    """The cases, not built yet (each builds its inputs on the device from its own seed when measured)."""
    f = "varlen_attention"

    def key(chunk):
        s = _shape(size, chunk, device)
        return f"{s['n_chunks']}x{s['chunk']}"

    return [lazy(f, f"chunks{key(500)}", _forward_case, device, size, 500, Rand(device, 0)),
            lazy(f, f"chunks{key(4096)}", _forward_case, device, size, 4096, Rand(device, 1)),
            lazy(f, f"bwd_chunks{key(500)}", _backward_case, device, size, Rand(device, 2)),
            lazy(f, "window", _window_case, device, size, Rand(device, 3)),
            lazy(f, "softcap", _soft_cap_case, device, size, Rand(device, 4))]
