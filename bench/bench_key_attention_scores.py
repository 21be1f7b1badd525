"""Benchmark of ``key_attention_scores``: FusionRAG's query-guided scoring.

gpu: a 64-token question against 32K context keys, bf16, 32 query heads, 8 kv heads, d 128.
Target: at most 10% of one full-prefill attention layer at 32K, i.e. a ragattn speedup of at
least 10x over the ``sdpa_causal_prefill`` baseline. ``naive_torch`` materialises the
``[heads, q, k]`` probabilities (and repeated K) as a straightforward implementation would.
``flops`` counts one Q K^T (2 * H * Tq * Tk * D); the kernel computes it twice (two passes).
``bytes`` counts what the two passes read from memory: q and k once per pass (re-reads of a q
tile by the programs of one pass hit L2) and the scores written once; the kernel's fp32 scratch
(the splits' partial LSEs, the per-kv-head partial scores: ~1.5% at the gpu size) is not counted.
Target: <= 60 us at the gpu size (>= 300 TFLOP/s-equivalent of the one Q K^T).
"""
from __future__ import annotations

import contextlib
import math

import torch

from .harness import Case, Rand, cpu_config, lazy, small_dtype

FAMILIES = ("key_attention_scores",)  # the Case.family values of this module (lets --only skip building it)


def _naive_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One sequence: [H, Tq, Tk] fp32 probabilities summed over heads and query rows."""
    group = q.shape[1] // k.shape[1]
    kr = k.repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.float(), kr.float()) / math.sqrt(q.shape[-1])
    return torch.softmax(logits, dim=-1).sum(dim=(0, 1))


def _flash_only(device: torch.device):
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def cases(device: torch.device, size: str):
    """One case, not built yet (it makes its inputs on the device when measured)."""
    return [lazy("key_attention_scores", "q", _case, device, size, Rand(device, 0))]


def _case(device: torch.device, size: str, rnd: Rand):
    import ragattn

    if size == "gpu":
        t_q, t_k, heads, kv_heads, head_dim, dtype = 64, 32768, 32, 8, 128, torch.bfloat16
    else:
        t_q, t_k, heads, kv_heads, head_dim, dtype = 8, 256, 4, 2, 64, small_dtype(device)
    q = rnd.randn(t_q, heads, head_dim, dtype=dtype)
    k = rnd.randn(t_k, kv_heads, head_dim, dtype=dtype)
    cu_q = torch.tensor([0, t_q], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, t_k], dtype=torch.int32, device=device)

    # One full-prefill attention layer over the whole context (the cost the scoring must be
    # small against). K/V are given all query heads so that the flash backend accepts them.
    pq = rnd.randn(1, heads, t_k, head_dim, dtype=dtype)
    pk = rnd.randn(1, heads, t_k, head_dim, dtype=dtype)
    pv = rnd.randn(1, heads, t_k, head_dim, dtype=dtype)

    def prefill():
        with _flash_only(device):
            return torch.nn.functional.scaled_dot_product_attention(pq, pk, pv, is_causal=True)

    def config():
        if device.type != "cuda":
            return cpu_config()
        from ragattn.triton_kernels.gpu_configs import lookup
        from ragattn.triton_kernels.key_attention_scores import config_key, launch_params

        p = launch_params(t_q, t_k, 1, heads, kv_heads, head_dim, dtype, device)
        where = lookup("key_attention_scores", torch.cuda.get_device_name(device), config_key(dtype, head_dim))[1]
        keep = ("column_pass", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "num_splits", "grid1", "grid2")
        return dict({k: p[k] for k in keep}, table=where.split(":")[0])

    elt = torch.finfo(dtype).bits // 8
    return Case(
        family="key_attention_scores",
        name=f"q{t_q}_k{t_k}_h{heads}_kv{kv_heads}_d{head_dim}",
        run=lambda: ragattn.key_attention_scores(q, k, cu_q, cu_k),
        baselines={
            "sdpa_causal_prefill": prefill,
            "naive_torch": lambda: _naive_scores(q, k),
        },
        flops=2.0 * heads * t_q * t_k * head_dim,
        bytes=2.0 * (q.numel() + k.numel()) * elt + 4.0 * t_k,
        passes=2,
        config=config,
        peak="matmul",
        peak_dtype=dtype,
        params={"dtype": str(dtype).replace("torch.", ""), "target": "speedup >= 10x over sdpa_causal_prefill"},
        backends={"sdpa_causal_prefill": "SDPA, flash backend only (one full-prefill layer, K/V at every head)",
                  "naive_torch": "einsum + softmax in fp32, [heads, q, k] materialised"},
    )
