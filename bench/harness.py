"""Benchmark plumbing shared by every ``bench/bench_*.py`` module.

A module contributes ``cases(device: torch.device, size: str) -> list[Case]`` where ``size`` is
"cpu" (small shapes that finish in seconds on the CPU) or "gpu" (the realistic shapes the issues'
performance targets name). The runner times ``Case.run`` and every baseline in the same process
and reports time, throughput (GB/s from ``Case.bytes`` or TFLOP/s from ``Case.flops``), percent of
the device's measured peak, and the speedup of ragattn over each baseline.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import statistics
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch


@dataclasses.dataclass
class Case:
    """One benchmark: the ragattn call and the baselines that compute the same thing.

    ``bytes`` is the useful memory traffic (read + written) of one call, ``flops`` the useful
    floating-point work (only visible query/key pairs for attention); give one or both.
    ``peak`` names the measured peak a percentage is taken of: "copy" (device-to-device copy
    bandwidth) or "matmul" (dense matmul throughput in ``peak_dtype``).
    """

    family: str
    name: str
    run: Callable[[], object]
    baselines: Dict[str, Callable[[], object]] = dataclasses.field(default_factory=dict)
    bytes: Optional[float] = None
    flops: Optional[float] = None
    peak: str = "copy"
    peak_dtype: torch.dtype = torch.bfloat16
    setup_ms: Dict[str, float] = dataclasses.field(default_factory=dict)  # e.g. mask creation time
    params: Dict[str, object] = dataclasses.field(default_factory=dict)


def small_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the small (``size == "cpu"``) cases: float32 on the CPU (its fast path), the
    GPU's bfloat16 elsewhere (``pytest bench`` runs the small cases on CUDA too, and the kernels
    are built and tuned for 16-bit data there)."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_us(fn: Callable[[], object], device: torch.device, *, min_time_s: float = 0.2, max_iters: int = 1000) -> float:
    """Median wall time of ``fn`` in microseconds.

    CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls).
    CPU: perf_counter around single calls after one warm-up, until ``min_time_s`` has elapsed.
    """
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3
    fn()  # warm-up (allocations, caches, Triton compilation)
    samples: List[float] = []
    start = time.perf_counter()
    while len(samples) < 3 or (time.perf_counter() - start < min_time_s and len(samples) < max_iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


_PEAKS: Dict[tuple, float] = {}


def measured_copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), measured once per process."""
    key = ("copy", str(device))
    if key not in _PEAKS:
        nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        us = time_us(lambda: dst.copy_(src), device)
        _PEAKS[key] = 2 * nbytes / (us * 1e-6) / 1e9
    return _PEAKS[key]


def measured_matmul_tflops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float:
    """Dense matmul throughput in TFLOP/s for ``dtype``, measured once per process."""
    if device.type == "cpu":
        dtype = torch.float32  # CPU bf16 matmul is not representative
    key = ("matmul", str(device), dtype)
    if key not in _PEAKS:
        n = 8192 if device.type == "cuda" else 1024
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        us = time_us(lambda: a @ b, device)
        _PEAKS[key] = 2 * n**3 / (us * 1e-6) / 1e12
    return _PEAKS[key]


def discover_modules() -> List[str]:
    """Names of every ``bench_*`` module of this package (``bench.*`` in a checkout, ``ragattn.bench.*``
    once installed)."""
    pkg = importlib.import_module(__package__)
    return sorted(f"{__package__}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__) if m.name.startswith("bench_"))


def _matches(case: Case, only: Optional[str]) -> bool:
    # A family substring ("kv_cache", "attention") or a case-name prefix; not any substring of a
    # case name, whose shape tags ("h32kv8") would match unrelated families.
    return only is None or only in case.family or case.name.startswith(only)


def iter_cases(device: torch.device, size: str, only: Optional[str] = None) -> Iterator[Tuple[str, List[Case]]]:
    """``(module name, its cases)`` for every bench module, one module at a time.

    Cases hold their input tensors, so building one module's cases only when the previous ones
    are measured and dropped keeps the GPU sizes of all families from being resident at once.
    A module whose ``FAMILIES`` cannot match ``only`` is not built at all; when ``only`` names no
    family of any module it is a case-name prefix, and every module is built and filtered.
    """
    modules = [importlib.import_module(m) for m in discover_modules()]
    by_family = only is not None and any(only in f for m in modules for f in getattr(m, "FAMILIES", ()))
    for mod in modules:
        if by_family and not any(only in f for f in getattr(mod, "FAMILIES", (only,))):
            continue
        cases = [c for c in mod.cases(device, size) if _matches(c, only)]
        if cases:
            yield mod.__name__, cases
        del cases  # drop our reference before the next module builds its inputs


def collect_cases(device: torch.device, size: str, only: Optional[str] = None) -> List[Case]:
    """Every case of every bench module (all built at once: for the CPU sizes and pytest)."""
    return [c for _, cases in iter_cases(device, size, only) for c in cases]


def measure_case(case: Case, device: torch.device) -> List[dict]:
    """Time a case and its baselines; one result row per implementation."""
    rows = []
    t_ragattn = time_us(case.run, device)
    impls = [("ragattn", t_ragattn)] + [(name, time_us(fn, device)) for name, fn in case.baselines.items()]
    for impl, us in impls:
        row = {
            "family": case.family,
            "case": case.name,
            "impl": impl,
            "time_us": us,
            "speedup_of_ragattn": us / t_ragattn,
            "params": {k: str(v) for k, v in case.params.items()},
        }
        if case.bytes is not None:
            gbs = case.bytes / (us * 1e-6) / 1e9
            row["GB/s"] = gbs
            if case.peak == "copy":
                row["pct_peak"] = 100.0 * gbs / measured_copy_bandwidth(device)
        if case.flops is not None:
            tflops = case.flops / (us * 1e-6) / 1e12
            row["TFLOP/s"] = tflops
            if case.peak == "matmul":
                row["pct_peak"] = 100.0 * tflops / measured_matmul_tflops(device, case.peak_dtype)
        if impl != "ragattn" and impl in case.setup_ms:
            row["setup_ms"] = case.setup_ms[impl]
        rows.append(row)
    return rows


def format_table(rows: List[dict]) -> str:
    """A markdown table of result rows."""
    head = ["family", "case", "impl", "time (us)", "GB/s", "TFLOP/s", "% peak", "ragattn speedup", "setup (ms)"]

    def f(v, fmt):
        return "" if v is None else format(v, fmt)

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                [
                    r["family"],
                    r["case"],
                    r["impl"],
                    f(r["time_us"], ".1f"),
                    f(r.get("GB/s"), ".1f"),
                    f(r.get("TFLOP/s"), ".2f"),
                    f(r.get("pct_peak"), ".1f"),
                    "" if r["impl"] == "ragattn" else f(r["speedup_of_ragattn"], ".2f") + "x",
                    f(r.get("setup_ms"), ".2f"),
                ]
            )
            + " |"
        )
    return "\n".join(lines)
