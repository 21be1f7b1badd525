"""The H100 (sm_90) limits and the benchmarks' GPU shapes the static report models, and its
occupancy and load-balance models (modelled, not measured)."""
from __future__ import annotations

import heapq
import math
from pathlib import Path
from typing import List, Tuple

# The config tables' entry the report compiles (triton_kernels/configs/*.json), and the window case of
# bench_varlen_attention (window_left = WINDOW_W - 1 over WINDOW_L tokens).
DEVICE_NAME = "NVIDIA H100 80GB HBM3"
WINDOW_W, WINDOW_L = 4096, 16384

H100 = dict(
    sms=132, regs_per_sm=65536, reg_alloc_per_warp=256, max_regs_per_thread=255,
    smem_per_sm=228 * 1024, smem_per_cta=227 * 1024, smem_reserved_per_cta=1024,
    threads_per_sm=2048, ctas_per_sm=32, hbm_bytes_per_s=3.35e12, bf16_flops_per_s=989e12,
)
# the benchmarks' GPU shapes the models below use (bench_paged_attention / bench_kv_cache, size "gpu")
PAGED_CTX, PAGED_BATCH, PAGED_WINDOW = 32768, 32, 4096  # decode: 32 sequences x 32K slots; window 4096
# sparse prefill: 15% of a 32K context's first 32704 rows plus its 64-row tail, one sequence (4969 rows)
SPARSE_TAIL = 64
SPARSE_ROWS = int(0.15 * (PAGED_CTX - SPARSE_TAIL)) + SPARSE_TAIL
KV_CACHE_SHAPES = [("N8192", 32, 8192), ("chunk512", 32, 512)]  # (tag, layers, rows); 8 KV heads, d 128, bf16
ROOT = Path(__file__).resolve().parent.parent.parent  # the repository: bench/sm90/h100.py
DEFAULT_OUT = Path("sm90-static")   # in the working folder; docs/perf/sm90-static.md is the page


def ctas_per_sm(regs: int, smem: int, threads: int) -> Tuple[int, str]:
    """CTAs per SM of an H100 and the limiting resource (modelled from the published limits)."""
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(regs, 1) * 32 / H100["reg_alloc_per_warp"]) * H100["reg_alloc_per_warp"]
    limits = {
        "registers": (H100["regs_per_sm"] // regs_per_warp) // warps,
        "threads": H100["threads_per_sm"] // threads,
        "ctas": H100["ctas_per_sm"],
    }
    if smem:
        limits["shared"] = H100["smem_per_sm"] // (smem + H100["smem_reserved_per_cta"])
    bound = min(limits, key=lambda k: limits[k])
    return limits[bound], bound



def schedule_balance(costs: List[int], slots: int) -> float:
    """Modelled load balance of a launch: programs start in launch order on the first free of
    ``slots`` CTA slots and run for their cost; returns (total / slots) / makespan (1.0: perfect)."""
    free = [0] * slots
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return round(sum(costs) / slots / max(max(free), 1), 3)
