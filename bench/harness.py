"""Benchmark plumbing shared by every ``bench/bench_*.py`` module.

A module contributes ``cases(device: torch.device, size: str) -> list[Case]`` where ``size`` is
"cpu" (small shapes that finish in seconds on the CPU) or "gpu" (the realistic shapes the
performance targets name). The runner times ``Case.run`` and every baseline in the same process
and reports time, throughput (GB/s from ``Case.bytes`` or TFLOP/s from ``Case.flops``), percent of
the device's measured peak, and the speedup of ragattn over each baseline.

Two checks make an impossible figure an error instead of a table row:

* before timing, ``Case.run`` is called once under a dispatch mode that records every tensor its
  ops receive and return; a case whose ``bytes`` exceed the bytes of those tensors' storages
  counts traffic its call cannot touch (``BytesNotTouched``): e.g. ``run`` lambdas built in a
  loop that look the loop's variables up when called, so every case runs the last iteration's
  inputs while counting its own shape's bytes;
* a row above 125% of the measured peak raises ``PeakExceeded`` with the case's name (``check_peak``:
  a kernel may beat torch's own copy by a little, not by 25%). The peaks are the best (not median)
  of their timings, since a peak is what the device can do.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import statistics
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

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
    # The launch configuration the ragattn call uses (tiles, warps, stages, grid, splits), asked of
    # the launcher's own config function when the case is measured; recorded in the tables.
    config: Optional[Callable[[], Dict[str, object]]] = None
    # How many times the call reads its tensors by design (a two-pass kernel: 2); ``bytes`` may be
    # at most that many times the bytes of the tensors the call sees (``check_bytes_touched``).
    passes: int = 1
    # How each implementation runs, where its name does not say it (a baseline's backend and
    # options: "torch.compile(fullgraph=True, dynamic=False)", "SDPA, flash backend only").
    backends: Dict[str, str] = dataclasses.field(default_factory=dict)


class PeakExceeded(RuntimeError):
    """A case reported more than 100% of a measured peak: its bytes/flops or its timing are wrong."""


class BytesNotTouched(RuntimeError):
    """A case counts more bytes than the tensors its call receives and returns hold."""


def small_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the small (``size == "cpu"``) cases: float32 on the CPU (its fast path), the
    GPU's bfloat16 elsewhere (``pytest tests/bench`` runs the small cases on CUDA too, and the kernels
    are built and tuned for 16-bit data there)."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_us(fn: Callable[[], object], device: torch.device, *, min_time_s: float = 0.2, max_iters: int = 1000,
            stat: str = "median") -> float:
    """Wall time of ``fn`` in microseconds, the ``stat`` ("median" or "min") of its samples.

    CUDA: ``triton.testing.do_bench`` (CUDA events on the current stream, L2 flushed between calls).
    CPU: perf_counter around single calls after one warm-up, until ``min_time_s`` has elapsed.
    """
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode=stat)) * 1e3
    fn()  # warm-up (allocations, caches, Triton compilation)
    samples: List[float] = []
    start = time.perf_counter()
    while len(samples) < 3 or (time.perf_counter() - start < min_time_s and len(samples) < max_iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return (min(samples) if stat == "min" else statistics.median(samples)) * 1e6


def synced_wall_us(fn: Callable[[], object], device: torch.device, *, iters: int = 10) -> float:
    """Mean wall time of ``iters`` back-to-back calls between two device synchronisations (host
    overhead and launch gaps included, caches not flushed): an independent figure recorded next to
    ``time_us`` on CUDA. A call's GPU time cannot exceed it by more than the L2 flush's effect, and
    a ``time_us`` far below it on a call without host work is worth a look."""
    fn()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - t0) / iters * 1e6


def touched_bytes(fn: Callable[[], object]) -> int:
    """Bytes of the distinct storages of every tensor that the ops ``fn`` dispatches receive or
    return (one call of ``fn``): an upper bound on the memory traffic a case may count."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    storages: Dict[tuple, int] = {}

    def note(x):
        if isinstance(x, torch.Tensor) and x.device.type != "meta":
            try:
                st = x.untyped_storage()
            except Exception:  # tensor subclasses without storage
                return
            storages[(str(x.device), st.data_ptr())] = max(storages.get((str(x.device), st.data_ptr()), 0), st.nbytes())

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for leaf in tree_leaves((args, kwargs)):
                note(leaf)
            out = func(*args, **kwargs)
            for leaf in tree_leaves(out):
                note(leaf)
            return out

    with Record():
        fn()
    return sum(storages.values())


def check_bytes_touched(case: "Case") -> None:
    """Raise ``BytesNotTouched`` when ``case.bytes`` exceeds what its call can touch."""
    if case.bytes is None:
        return
    seen = touched_bytes(case.run)
    if case.bytes > case.passes * seen:
        raise BytesNotTouched(
            f"bench case {case.family}/{case.name!r} counts {case.bytes:.4g} bytes but its call only sees "
            f"{seen:.4g} bytes of tensors ({case.passes} pass(es) over them): it runs other inputs than it "
            f"counts (a late-bound closure?) or its bytes formula is wrong"
        )


PEAK_SLACK = 125.0  # percent of a measured peak above which a row is called impossible


def check_peak(case: "Case", row: dict, device: Optional[torch.device] = None) -> None:
    """Raise ``PeakExceeded`` when a result row reports more than ``PEAK_SLACK`` (125%) of a measured
    peak. The peaks are what torch's own copy, sum and matmul reach, not the datasheet's, and a
    tuned kernel may beat them by a little (SDPA's decode read at 102% of them on an H100); a
    wrong byte or flop count is off by far more (878% for the kv_cache closure bug). With
    ``device``, a row over 100% first has the peak measured again (a peak measured while the
    machine was busy is too low) and its percentage recomputed."""
    pct = row.get("pct_peak")
    if pct is not None and pct > 100.0 and device is not None:
        _PEAKS.pop(("copy", str(device)), None)
        _PEAKS.pop(("matmul", str(device), case.peak_dtype), None)
        _PEAKS.pop(("matmul", str(device), torch.float32), None)
        peak = measured_copy_bandwidth(device) if case.peak == "copy" else measured_matmul_tflops(device, case.peak_dtype)
        pct = row["pct_peak"] = 100.0 * (row["GB/s"] if case.peak == "copy" else row["TFLOP/s"]) / peak
    if pct is not None and pct > PEAK_SLACK:
        what = f"{row['GB/s']:.1f} GB/s" if case.peak == "copy" else f"{row['TFLOP/s']:.1f} TFLOP/s"
        raise PeakExceeded(
            f"bench case {case.family}/{case.name!r} ({row['impl']}): {pct:.0f}% of the measured {case.peak} peak "
            f"({what} in {row['time_us']:.1f} us) is impossible: its bytes/flops count or its timing is wrong"
        )


_PEAKS: Dict[tuple, float] = {}


def measured_copy_bandwidth(device: torch.device) -> float:
    """The device's memory bandwidth in GB/s, measured once per process: the best of a
    device-to-device copy (bytes read + written) and a read-only stream (a sum, bytes read), since
    a read-only kernel (decode attention) can stream faster than a copy. Neither is the hardware's
    limit (a decode attention kernel can read faster than both), which is what
    ``check_peak``'s slack is for. CUDA: 1 GiB buffers (do_bench flushes L2
    between calls, as it does for the cases). CPU: the best of 256 KiB, 4 MiB and 64 MiB, since the
    CPU cases' working sets sit in the caches (their timings do not flush them) and a percentage of
    the DRAM rate alone would pass 100%."""
    key = ("copy", str(device))
    if key not in _PEAKS:
        sizes = [1 << 30] if device.type == "cuda" else [256 << 10, 4 << 20, 64 << 20]
        best = 0.0
        for nbytes in sizes:
            src = torch.empty(nbytes, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            us = time_us(lambda: dst.copy_(src), device, stat="min")
            best = max(best, 2 * nbytes / (us * 1e-6) / 1e9)
            del dst
            words = src.view(torch.float32).fill_(1.0)
            us = time_us(lambda: words.sum(), device, stat="min")
            best = max(best, nbytes / (us * 1e-6) / 1e9)
            del src, words
        _PEAKS[key] = best
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
        us = time_us(lambda: a @ b, device, stat="min")
        _PEAKS[key] = 2 * n**3 / (us * 1e-6) / 1e12
    return _PEAKS[key]


def load_peaks(device: torch.device, path: Optional[str] = None) -> Dict[str, float]:
    """The copy and bf16 matmul peaks of ``device``: read from the JSON file ``path`` when it
    exists and was measured on this device, else measured (and written to ``path`` if given)."""
    import json
    import os

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if path and os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if saved.get("device") == name:
            _PEAKS[("copy", str(device))] = saved["copy_GBps"]
            _PEAKS[("matmul", str(device), torch.float32 if device.type == "cpu" else torch.bfloat16)] = saved["matmul_TFLOPs"]
    peaks = {"copy_GBps": measured_copy_bandwidth(device), "matmul_TFLOPs": measured_matmul_tflops(device, torch.bfloat16)}
    if path and not os.path.exists(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"device": name, **peaks}, f)
    return peaks


def discover_modules() -> List[str]:
    """Names of every ``bench_*`` module of this package (``bench.*`` in a checkout, ``ragattn.bench.*``
    once installed)."""
    pkg = importlib.import_module(__package__)
    return sorted(f"{__package__}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__) if m.name.startswith("bench_"))


def load_modules() -> list:
    """Every ``bench_*`` module, imported."""
    return [importlib.import_module(m) for m in discover_modules()]


@dataclasses.dataclass
class LazyCase:
    """A case not built yet: its family, a short ``key`` that its built name starts with, and the
    function that builds it (allocates its inputs). A module's ``cases()`` returns these, so that
    the runner builds only the cases asked for, one at a time, and a case whose inputs cannot be
    made (out of memory, no backend) fails alone. ``build`` may return a list of cases that share
    their inputs (then ``key`` is a prefix of all their names; "" for any name)."""

    family: str
    key: str
    build: Callable[[], Union["Case", List["Case"]]]

    def build_all(self) -> List["Case"]:
        built = self.build()
        return built if isinstance(built, list) else [built]


def lazy(family: str, key: str, build: Callable[..., "Case"], *args) -> LazyCase:
    """``LazyCase(family, key, lambda: build(*args))`` with ``args`` bound now (not late-bound)."""
    return LazyCase(family, key, lambda: build(*args))


class Rand:
    """Seeded random inputs made on the device itself: a 32K-token decode batch is ~1 G values,
    which took minutes to draw on the host and copy. ``cpu`` is a host generator for the small
    index tensors (permutations, row choices) that are cheap anywhere."""

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.cpu = torch.Generator().manual_seed(seed)
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Standard normal values of ``shape`` in ``dtype`` on the device (drawn in float32)."""
        return torch.randn(*shape, generator=self.gen, device=self.device).to(dtype)


def _only_terms(only: Optional[str]) -> Optional[List[str]]:
    return None if only is None else [t.strip() for t in only.split(",") if t.strip()]


def matches(case: Case, only: Optional[str]) -> bool:
    # A family substring ("kv_cache", "attention") or a case-name prefix; not any substring of a
    # case name, whose shape tags ("h32kv8") would match unrelated families. ``only`` may list
    # several, comma-separated.
    terms = _only_terms(only)
    return terms is None or any(t in case.family or case.name.startswith(t) for t in terms)


def _may_match(spec: LazyCase, terms: Optional[List[str]]) -> bool:
    """Whether the built case could match (decided without building it): a family substring, or a
    name prefix that agrees with the case's key as far as both go."""
    return terms is None or any(t in spec.family or t.startswith(spec.key) or spec.key.startswith(t)
                                for t in terms)


def _as_lazy(item) -> LazyCase:
    return item if isinstance(item, LazyCase) else LazyCase(item.family, item.name, lambda: item)


def iter_specs(device: torch.device, size: str, only: Optional[str] = None) -> Iterator[Tuple[str, List[LazyCase]]]:
    """``(module name, its cases not built yet)`` for every bench module that may match ``only``.

    A module whose ``FAMILIES`` cannot match ``only`` is not asked at all; when ``only`` names no
    family of any module it is a case-name prefix, and every module's cases are filtered by key.
    """
    terms = _only_terms(only)
    modules = load_modules()
    fams = [f for m in modules for f in getattr(m, "FAMILIES", ())]
    by_family = terms is not None and all(any(t in f for f in fams) for t in terms)
    for mod in modules:
        if by_family and not any(t in f for t in terms for f in getattr(mod, "FAMILIES", (t,))):
            continue
        specs = [s for s in map(_as_lazy, mod.cases(device, size)) if _may_match(s, terms)]
        if specs:
            yield mod.__name__, specs


def iter_cases(device: torch.device, size: str, only: Optional[str] = None) -> Iterator[Tuple[str, List[Case]]]:
    """``(module name, its built cases)`` for every bench module, one module at a time (a module's
    cases are built together: for the CPU sizes and pytest; the runner builds one case at a time
    through ``iter_specs``)."""
    for name, specs in iter_specs(device, size, only):
        cases = [c for s in specs for c in s.build_all() if matches(c, only)]
        if cases:
            yield name, cases
        del cases


def collect_cases(device: torch.device, size: str, only: Optional[str] = None) -> List[Case]:
    """Every case of every bench module (all built at once: for the CPU sizes and pytest)."""
    return [c for _, cases in iter_cases(device, size, only) for c in cases]


def cpu_config() -> Dict[str, object]:
    """The ``config`` of a case on CPU tensors: which CPU backend ran (no GPU launch configuration)."""
    from ragattn import _extension

    return {"backend": f"cpu:{_extension.cpu_backend()}"}


def case_config(case: Case) -> Optional[Dict[str, object]]:
    """The launch configuration ``case.config`` reports (None when the case gives none)."""
    if case.config is None:
        return None
    return {k: (v if isinstance(v, (int, float, bool, str)) or v is None else str(v)) for k, v in case.config().items()}


def launched_kernels(fn: Callable[[], object], device: torch.device, top: int = 3) -> Optional[List[str]]:
    """The names of the device kernels one call of ``fn`` launches, the longest-running first (at
    most ``top``): which backend a baseline really ran (SDPA's flash, memory-efficient or cuDNN
    kernel; FlexAttention's compiled Triton kernel; a cuBLAS GEMM). None on the CPU (no kernels)
    or where the profiler cannot run."""
    if device.type != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            synchronize(device)
        times: Dict[str, float] = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                times[ev.name] = times.get(ev.name, 0.0) + ev.device_time_total
        return [n[:120] for n, _ in sorted(times.items(), key=lambda kv: -kv[1])[:top]]
    except Exception as exc:  # pragma: no cover - profiler unavailable
        return [f"(profiler failed: {type(exc).__name__})"]


def measure_case(case: Case, device: torch.device) -> List[dict]:
    """Time a case and its baselines; one result row per implementation.

    Raises ``BytesNotTouched`` (before timing) or ``PeakExceeded`` (after) with the case's name
    instead of reporting an impossible figure."""
    check_bytes_touched(case)
    rows = []
    fns = [("ragattn", case.run)] + list(case.baselines.items())
    impls = [(name, time_us(fn, device)) for name, fn in fns]
    walls = {name: synced_wall_us(fn, device) for name, fn in fns} if device.type == "cuda" else {}
    kernels = {name: launched_kernels(fn, device) for name, fn in fns} if device.type == "cuda" else {}
    t_ragattn = impls[0][1]
    config = case_config(case)
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
        if impl in walls:
            row["wall_us"] = walls[impl]
        if kernels.get(impl):
            row["kernels"] = kernels[impl]
        if impl in case.backends:
            row["backend"] = case.backends[impl]
        if impl == "ragattn" and config is not None:
            row["config"] = config
        check_peak(case, row, device)
        rows.append(row)
    return rows


def _config_text(config: Optional[dict]) -> str:
    return "" if not config else " ".join(f"{k}={v}" for k, v in config.items())


def format_table(rows: List[dict]) -> str:
    """A markdown table of result rows."""
    head = ["family", "case", "impl", "time (us)", "GB/s", "TFLOP/s", "% peak", "ragattn speedup", "setup (ms)",
            "synced wall (us)", "config", "backend"]

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
                    f(r.get("wall_us"), ".1f"),
                    _config_text(r.get("config")),
                    "; ".join(x for x in [r.get("backend")] + (r.get("kernels") or []) if x).replace("|", "/"),
                ]
            )
            + " |"
        )
    return "\n".join(lines)
