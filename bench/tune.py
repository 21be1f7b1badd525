"""``python -m ragattn.bench.tune FAMILY``: time a kernel family's launch configurations on the GPU at
hand and write the fastest into its config table (``triton_kernels/configs/FAMILY.json``, keyed by
``torch.cuda.get_device_name``).

    python -m bench.tune paged_attention --device cuda        # quick: ~60 s, the benchmark's classes
    python -m bench.tune paged_attention --list               # what it would time (no GPU needed)
    python -m bench.tune varlen_attention --keys fwd/16bit/d128 --budget-s 120
    python -m bench.tune varlen_attention --full --max-candidates 24 --budget-s 600   # the wide sweep
    python -m bench.tune key_attention_scores --out /tmp/configs                      # write elsewhere

Quick mode (the default) times, for each of the family's benchmark shape classes (``quick_keys``),
the table's current config for this GPU first, then a short list of variants chosen by the static
sm_90 report (``quick_variants``: deeper decode prefetch, the prefill tile height, wider key
tiles); ``--full`` sweeps the whole space nearest-first instead. Every candidate runs through the
real launcher (``gpu_configs.override``) on a representative problem whose inputs are made on the
device, its output is checked against the current config's, and it is timed with
``triton.testing.do_bench`` (median, L2 flushed); candidates that fail to compile or launch, or
compute another result, are skipped. ``--budget-s`` (default 60) bounds the timing: each class gets
an equal share of what is left, and a candidate is started only within it (the current config
always runs). A table of every candidate tried (time, ratio to the current config, or why it was
skipped) is printed, and the fastest of each class is written with the commit, date and timings in
the entry's ``source``: a variant replaces the current config only when it is more than
``MIN_GAIN`` faster. Nothing is timed without a CUDA GPU: on a CPU it refuses (exit status 2),
since a timing in the interpreter says nothing about a GPU.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import math
import os
import sys
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

Config = Dict[str, object]
MIN_GAIN = 0.01  # a variant must beat the current config by more than this share to replace it
REFERENCE_GPU = "NVIDIA H100 80GB HBM3"  # whose table entry --list shows as "current" without a GPU


# ---------------------------------------------------------------------------------------------
# The sweep (pure: tested on the CPU with a fake timer)
def _smem_bytes(block_m: int, block_n: int, block_d: int, stages: int, elt: int, kv_tiles: int = 2) -> int:
    """Shared memory a pipelined attention loop needs, roughly: the query tile plus ``stages`` buffers
    of ``kv_tiles`` key-side tiles (K and V)."""
    return elt * block_d * (block_m + max(1, stages) * kv_tiles * block_n)


SMEM_LIMIT = 227 * 1024  # sm_90's per-CTA maximum (A100: 163 KB; a candidate over it fails to launch and is skipped)


# The anchors the sweeps start from (FA-style forward tiles; the backward's smaller ones; the
# key_attention_scores H100 entry): candidates are ordered nearest first, so --max-candidates N
# times the N most plausible ones on a short GPU lease.
ANCHORS = {
    "fwd": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    "bwd": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
    "key_attention_scores": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, waves=3.0, column_pass="split"),
    "paged_decode": dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=2, waves=4.0),
    "paged_prefill": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, waves=4.0),
}


def nearest_first(cands: List[Config], anchor: Config) -> List[Config]:
    """``cands`` sorted by distance to ``anchor`` (log2 steps of tiles, warps and waves, stages; TMA
    after the pointer loads at equal distance), stable."""
    def dist(c):
        d = sum(abs(math.log2(c[k]) - math.log2(anchor[k])) for k in ("BLOCK_M", "BLOCK_N", "num_warps"))
        d += abs(c["num_stages"] - anchor["num_stages"])
        if "waves" in anchor:
            d += abs(math.log2(c["waves"]) - math.log2(anchor["waves"]))
        return (d, bool(c.get("tma")), c.get("column_pass", "") != anchor.get("column_pass", ""))

    return sorted(cands, key=dist)


def varlen_candidates(shape_key: str) -> List[Config]:
    """The sweep of a ``varlen_attention`` shape class: FA-style tiles around the anchors (forward
    BLOCK_M 64-128, BLOCK_N 32-128, 4-8 warps, 2-4 stages, with and without TMA for the mask-free
    loop; backward smaller tiles), without the ones whose pipelined tiles cannot fit in shared memory."""
    kernel, dt, dclass = shape_key.split("/")[:3]
    block_d = int(dclass[1:])
    elt = 4 if dt == "fp32" else 2
    if kernel == "fwd":
        space = itertools.product((32, 64, 128), (16, 32, 64, 128), (4, 8), (1, 2, 3, 4))
    else:
        space = itertools.product((16, 32, 64), (16, 32, 64), (4, 8), (1, 2, 3))
    out = []
    for bm, bn, warps, stages in space:
        if bm * bn < 32 * warps * 4:  # fewer than 4 elements a thread: the tile is too small for the warps
            continue
        if _smem_bytes(bm, bn, block_d, stages, elt, 2 if kernel == "fwd" else 4) > SMEM_LIMIT:
            continue
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages))
        if kernel == "fwd" and bm >= 64:  # the forward's mask-free loop by TMA (Hopper; else the pointer path)
            out.append(dict(out[-1], tma=True))
    return nearest_first(out, ANCHORS["fwd" if kernel == "fwd" else "bwd"])


def key_attention_scores_candidates(shape_key: str) -> List[Config]:
    """The sweep of a ``key_attention_scores`` shape class: tiles, warps, stages, the pass-1 wave target
    and pass 2's design (``column_pass``; the table's first at equal distance)."""
    from ragattn.triton_kernels.key_attention_scores import COLUMN_PASSES

    dt, dclass = shape_key.split("/")[:2]
    block_d = int(dclass[1:])
    elt = 4 if dt == "fp32" else 2
    out = []
    for bm, bn, warps, stages, waves, cp in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4),
                                                              (1.0, 2.0, 3.0, 4.0), COLUMN_PASSES):
        if _smem_bytes(bm, bn, block_d, stages, elt, 1) > SMEM_LIMIT:
            continue
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, waves=waves, column_pass=cp))
    return nearest_first(out, ANCHORS["key_attention_scores"])


PAGED_M_TILES = {"decode": (16,), "verify": (64,), "prefill": (64, 128)}  # query tile heights swept per kind


def paged_attention_candidates(shape_key: str) -> List[Config]:
    """The sweep of a ``paged_attention`` shape class: the key tile, warps, stages 2-5 and the
    split-KV wave target; for prefill also the query tile height (``BLOCK_M``: stacked rows, 64 or
    128; a 64-row tile runs its whole key tiles in a loop of their own, V pipelined like K). A
    config the launcher's shared-memory model (``paged_plan.smem_bytes``, the compiler's
    figure) would shrink is left out, so every candidate runs as listed."""
    from ragattn.triton_kernels.paged_plan import SMEM_BUDGET, smem_bytes

    kind, dt, dclass = shape_key.split("/")[:3]
    block_d = int(dclass[1:])
    elt = 4 if dt == "fp32" else 2
    out = []
    window = shape_key.endswith("/window")
    for m_tile, bn, warps, stages, waves, edge in itertools.product(
            PAGED_M_TILES[kind], (16, 32, 64, 128), (2, 4, 8), (2, 3, 4, 5), (2.0, 4.0, 8.0),
            (True, False) if window else (None,)):
        if kind == "prefill" and waves != 4.0:  # prefill grids fill the GPU without splits
            continue
        if m_tile * bn < 32 * warps * 4 or smem_bytes(m_tile, bn, block_d, elt, stages) > SMEM_BUDGET:
            continue
        out.append(dict(BLOCK_M=m_tile, BLOCK_N=bn, num_warps=warps, num_stages=stages, waves=waves))
        if edge is not None:  # a window class: the edge tiles in one loop (edge_loop) or a loop each
            out[-1]["edge_loop"] = edge
    return nearest_first(out, ANCHORS["paged_decode" if kind != "prefill" else "paged_prefill"])


def sweep(candidates: Iterable[Config], time_config: Callable[[Config], float],
          log: Callable[[str], None] = lambda s: None, stop: Callable[[], bool] = lambda: False,
          ) -> Tuple[Optional[Config], List[Tuple[Config, float]]]:
    """Time every candidate (``time_config`` returns microseconds, or raises when the candidate
    cannot run or computes a wrong result: it is skipped) until ``stop()`` says the budget is spent
    (checked before each candidate but the first); returns (the fastest, every timing).
    Ties keep the earlier candidate (the sweep's order is deterministic)."""
    best, best_us, timings = None, math.inf, []
    for i, cfg in enumerate(candidates):
        if i and stop():
            log(f"  budget spent: {cfg} and later not timed")
            break
        try:
            us = float(time_config(cfg))
        except Exception as exc:  # compile/launch failure, out of resources, wrong output
            log(f"  skip {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
            continue
        if not math.isfinite(us) or us <= 0:
            log(f"  skip {cfg}: time {us}")
            continue
        timings.append((cfg, us))
        log(f"  {us:9.1f} us  {cfg}")
        if us < best_us:
            best, best_us = cfg, us
    return best, timings


def _same(a: Config, b: Config) -> bool:
    """Equal configs, a missing ``tma`` read as False."""
    return dict(a, tma=bool(a.get("tma"))) == dict(b, tma=bool(b.get("tma")))


def tune_family(family: "Family", keys: List[str], time_config: Callable[[str, Config], float],
                log: Callable[[str], None] = print, max_candidates: Optional[int] = None,
                candidates: Optional[Callable[[str], List[Config]]] = None, budget_s: Optional[float] = None,
                clock: Callable[[], float] = time.monotonic) -> Dict[str, dict]:
    """Time each shape key's candidates (``candidates(key)``, default the full sweep; the first is
    the baseline the others are compared with); returns {shape key: {"config": the one to write,
    "us": its time, "tried": n, "timings": [(config, us)], "baseline": (config, us) or None,
    "untimed": n}}. With ``budget_s``, each key gets an equal share of the time left."""
    results = {}
    start = clock()
    for i, key in enumerate(keys):
        cands = (candidates or family.candidates)(key)
        if max_candidates:
            cands = cands[:max_candidates]
        log(f"{family.name} {key}: {len(cands)} candidates")
        stop = lambda: False  # noqa: E731
        if budget_s is not None:
            deadline = clock() + max(0.0, budget_s - (clock() - start)) / (len(keys) - i)
            stop = lambda _d=deadline: clock() > _d  # noqa: E731
        seen: List[Config] = []

        def timed(cfg, _k=key):
            seen.append(cfg)
            return time_config(_k, cfg)

        best, timings = sweep(cands, timed, log, stop)
        if best is None:
            log(f"{family.name} {key}: no candidate ran; the table keeps its entry")
            continue
        base = next(((c, us) for c, us in timings if _same(c, cands[0])), None)
        best_us = min(us for _, us in timings)
        if base is not None and best_us > base[1] * (1 - MIN_GAIN):  # within noise: keep the current config
            best, best_us = base
        results[key] = dict(config=best, us=best_us, tried=len(timings), timings=timings, baseline=base,
                            untimed=len(cands) - len(seen))
    return results


def results_table(family: str, results: Dict[str, dict]) -> str:
    """What was tried, per shape key: each timed config, its time and its ratio to the baseline
    (the current config), the one chosen marked."""
    lines = [f"| {family} class | config | us | vs current | |", "|---|---|---|---|---|"]
    for key, r in results.items():
        base_us = r["baseline"][1] if r.get("baseline") else None
        for cfg, us in sorted(r["timings"], key=lambda t: t[1]):
            mark = ("chosen" if cfg is r["config"] else "") + (" (current)" if r.get("baseline") and cfg is r["baseline"][0] else "")
            ratio = f"{base_us / us:.3f}x" if base_us else "-"
            text = ", ".join(f"{k}={v}" for k, v in sorted(cfg.items()))
            lines.append(f"| {key} | {text} | {us:.1f} | {ratio} | {mark.strip()} |")
        if r.get("untimed"):
            lines.append(f"| {key} | {r['untimed']} more not timed (budget) | | | |")
    return "\n".join(lines)


def source_text(device_name: str, commit: str, results: Dict[str, dict]) -> str:
    times = ", ".join(f"{k} {r['us']:.1f} us" for k, r in sorted(results.items()))
    return (f"measured by ragattn.bench.tune on {device_name}, commit {commit}, "
            f"{datetime.date.today().isoformat()} (do_bench median; {times})")


# ---------------------------------------------------------------------------------------------
# The families: shape classes, candidates, a representative problem per class
def _randn(gen: torch.Generator, *shape, dtype, device) -> torch.Tensor:
    """Random values made on the device (a decode cache is ~2 G of them: the CPU would take minutes)."""
    return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def _generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


class Family:
    name: str
    keys: Tuple[str, ...]
    quick_keys: Tuple[str, ...]  # the benchmark's shape classes: what the quick run tunes

    def candidates(self, shape_key: str) -> List[Config]:
        raise NotImplementedError

    def quick_variants(self, shape_key: str) -> List[Config]:
        """The few configs the quick run times after the current one."""
        raise NotImplementedError

    def quick_candidates(self, shape_key: str, device_name: Optional[str]) -> List[Config]:
        """The current config of ``device_name`` (the table's lookup), then ``quick_variants``
        without repeats."""
        from ragattn.triton_kernels import gpu_configs

        current = gpu_configs.get_config(self.name, device_name or gpu_configs.DEFAULT, shape_key)
        out: List[Config] = [current]
        for c in self.quick_variants(shape_key):
            if not any(_same(c, o) for o in out):
                out.append(c)
        return out

    def problem(self, shape_key: str, device: torch.device) -> Callable[[], object]:
        """A call of the op at a representative shape of the class (the launcher reads the table)."""
        raise NotImplementedError


class VarlenFamily(Family):
    name = "varlen_attention"
    keys = tuple(f"{k}/16bit/{d}{w}" for d in ("d64", "d128", "d256")
                 for k, w in (("fwd", ""), ("fwd", "/window"), ("dq", ""), ("dkdv", "")))
    quick_keys = ("fwd/16bit/d128", "fwd/16bit/d128/window", "dq/16bit/d128", "dkdv/16bit/d128")

    def candidates(self, shape_key):
        return varlen_candidates(shape_key)

    def quick_variants(self, shape_key):
        c = lambda bm, bn, w, s, **kw: dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, **kw)  # noqa: E731
        if shape_key.startswith("fwd/"):  # wider key tiles (masked ones in slices: spill-free), TMA, the default
            return [c(128, 64, 8, 3, masked_sub=2), c(128, 64, 8, 3, masked_sub=2, tma=True),
                    c(128, 128, 8, 3, masked_sub=4), c(128, 64, 8, 3), c(64, 64, 4, 3), c(64, 32, 4, 3)]
        return [c(64, 32, 4, 2), c(32, 32, 4, 2), c(64, 64, 8, 2), c(32, 64, 4, 2)]

    def problem(self, shape_key, device):
        import ragattn

        kernel, dt, dclass = shape_key.split("/")[:3]
        window = shape_key.endswith("/window")
        d = int(dclass[1:])
        dtype = torch.float32 if dt == "fp32" else torch.bfloat16
        gen = _generator(device)
        n, chunk, tail = (8, 1024, 50)
        L = n * chunk + tail
        q = _randn(gen, L, 32, d, dtype=dtype, device=device)
        k = _randn(gen, L, 8, d, dtype=dtype, device=device)
        v = _randn(gen, L, 8, d, dtype=dtype, device=device)
        cu = torch.tensor([0, L], dtype=torch.int32, device=device)
        if window:
            return lambda: ragattn.varlen_attention(q, k, v, cu, cu, window_left=2047)[0]
        blk = torch.cat([torch.arange(n, device=device).repeat_interleave(chunk),
                         torch.full((tail,), -1, device=device)]).to(torch.int32)
        if kernel == "fwd":
            return lambda: ragattn.varlen_attention(q, k, v, cu, cu, q_block=blk, kv_block=blk)[0]
        out, lse = ragattn.varlen_attention(q, k, v, cu, cu, q_block=blk, kv_block=blk)
        dout = _randn(gen, *out.shape, dtype=dtype, device=device)
        return lambda: torch.ops.ragattn.varlen_attention_backward(
            dout, q, k, v, out, lse, cu, cu, None, None, blk, blk, True, None)[0 if kernel == "dq" else 1]


class KeyScoresFamily(Family):
    name = "key_attention_scores"
    keys = ("16bit/d64", "16bit/d128", "16bit/d256")
    quick_keys = ("16bit/d128",)

    def candidates(self, shape_key):
        return key_attention_scores_candidates(shape_key)

    def quick_variants(self, shape_key):
        c = lambda bm, bn, w, s, waves, cp="split": dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s,  # noqa: E731
                                                         waves=waves, column_pass=cp)
        return [c(128, 64, 8, 2, 3.0, "tile"), c(128, 64, 8, 3, 3.0), c(128, 128, 8, 3, 2.0), c(128, 64, 8, 2, 2.0),
                c(64, 64, 4, 3, 4.0)]

    def problem(self, shape_key, device):
        import ragattn

        dt, dclass = shape_key.split("/")[:2]
        d = int(dclass[1:])
        dtype = torch.float32 if dt == "fp32" else torch.bfloat16
        gen = _generator(device)
        q = _randn(gen, 64, 32, d, dtype=dtype, device=device)
        k = _randn(gen, 32768, 8, d, dtype=dtype, device=device)
        cu_q = torch.tensor([0, 64], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 32768], dtype=torch.int32, device=device)
        return lambda: ragattn.key_attention_scores(q, k, cu_q, cu_k)


class PagedFamily(Family):
    """``paged_attention``: each class is timed on the sum of a few problems of its kind, so one
    config serves the batch sizes and windows a server sees (bf16, 32 query / 8 kv heads, page 16,
    shuffled pages): decode at batch 32 x 32K, batch 4 x 32K and batch 32 x 32K under a 4096 window;
    verify (5-token speculative tails) at batch 32 x 8K; prefill 15% scattered rows of 32K plus a
    64-row tail (the benchmark's sparse prefill)."""
    name = "paged_attention"
    keys = tuple(f"{k}/16bit/{d}" for k in ("decode", "verify", "prefill") for d in ("d64", "d128")) + (
        "decode/16bit/d128/window",)
    quick_keys = ("decode/16bit/d128", "prefill/16bit/d128")

    def candidates(self, shape_key):
        return paged_attention_candidates(shape_key)

    def quick_variants(self, shape_key):
        c = lambda bm, bn, w, s, waves=4.0, **kw: dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, waves=waves,  # noqa: E731
                                                       **kw)
        kind = shape_key.split("/")[0]
        if shape_key.endswith("/window"):  # the loops (68e7ebf's three, or the edge loop) x prefetch depth
            return [c(16, 64, 4, s, edge_loop=e) for e in (True, False) for s in (3, 5)] + [
                c(16, 32, 4, 3, edge_loop=True)]
        if kind == "decode":  # deeper prefetch: 5 stages double-buffer K and V (sm_90: 71.7 KB, 3 CTAs/SM
            # without a window, so 6 waves of programs fill whole rounds of 3 per SM)
            return [c(16, 64, 4, 5), c(16, 64, 4, 3, 6.0), c(16, 64, 4, 5, 6.0), c(16, 64, 4, 2), c(16, 32, 4, 5),
                    c(16, 128, 4, 3)]
        if kind == "verify":
            return [c(64, 64, 4, 3), c(64, 32, 4, 3), c(64, 64, 4, 5)]
        # the 128-row loop with V in registers (the default before pipeline_v: the A/B baseline), the
        # tile height (64-row tiles run whole key tiles in a loop of their own), deeper prefetch
        return [c(128, 64, 8, 3, pipeline_v=False), c(64, 64, 8, 3), c(64, 64, 4, 3),
                c(128, 64, 8, 5, pipeline_v=True), c(128, 32, 8, 3, pipeline_v=True)]

    def problem(self, shape_key, device):
        import ragattn

        kind, dt, dclass = shape_key.split("/")[:3]
        d = int(dclass[1:])
        dtype = torch.float32 if dt == "fp32" else torch.bfloat16
        gen = _generator(device)
        page = 16
        caches = {}

        def one(batch, ctx, rows, window=-1):
            pages = -(-ctx // page)
            if (batch, ctx) not in caches:  # decode and its window case read the same cache
                bt = torch.randperm(batch * pages, generator=gen, device=device).view(batch, pages).to(torch.int32)
                k = _randn(gen, batch * pages, page, 8, d, dtype=dtype, device=device)
                v = _randn(gen, batch * pages, page, 8, d, dtype=dtype, device=device)
                caches[batch, ctx] = (bt, k, v)
            bt, k, v = caches[batch, ctx]
            if rows == "sparse":
                tail = 64
                body = torch.randperm(ctx - tail, generator=gen, device=device)[: int(0.15 * (ctx - tail))]
                pos = torch.cat([torch.sort(body).values, torch.arange(ctx - tail, ctx, device=device)])
            else:
                pos = torch.arange(ctx - rows, ctx, device=device).repeat(batch)
            q_pos = pos.to(torch.int32)
            n = q_pos.numel() // batch
            q = _randn(gen, q_pos.numel(), 32, d, dtype=dtype, device=device)
            cu = (torch.arange(batch + 1, device=device) * n).to(torch.int32)
            kv_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            table = ragattn.PageTable.from_block_table(bt, kv_lens)

            def run():  # planned from maxima (no host sync) under whatever config is in force
                plan = ragattn.plan_paged_attention(cu, table, num_heads=32, num_kv_heads=8, head_dim=d, dtype=dtype,
                                                    window_left=window, max_q_len=n, max_kv_len=ctx)
                return ragattn.run_paged_attention(plan, q, q_pos, k, v)[0]
            return run

        if shape_key.endswith("/window"):  # its own class: the window decode alone
            runs = [one(32, 32768, 1, window=4095)]
        elif kind == "decode":
            runs = [one(32, 32768, 1), one(4, 32768, 1), one(32, 32768, 1, window=4095)]
        elif kind == "verify":
            runs = [one(32, 8192, 5)]
        else:
            runs = [one(1, 32768, "sparse")]
        return lambda: torch.cat([r().flatten() for r in runs])


FAMILIES: Dict[str, Family] = {f.name: f for f in (VarlenFamily(), KeyScoresFamily(), PagedFamily())}


def _gpu_timer(family: Family, device: torch.device, warmup_ms: int, rep_ms: int):
    """``time_config(shape_key, config) -> us``: the launcher under ``override``, checked against
    the table's own config (a wrong result raises, so the candidate is skipped), do_bench median."""
    from triton.testing import do_bench

    from ragattn.triton_kernels import gpu_configs

    problems: Dict[str, Tuple[Callable[[], object], torch.Tensor]] = {}

    def time_config(shape_key: str, cfg: Config) -> float:
        if shape_key not in problems:
            problems.clear()  # one class's inputs on the device at a time
            torch.cuda.empty_cache()
            run = family.problem(shape_key, device)
            problems[shape_key] = (run, run().float())
        run, want = problems[shape_key]
        with gpu_configs.override(family.name, shape_key, cfg):
            got = run().float()
            torch.cuda.synchronize(device)
            err = (got - want).abs().nan_to_num(nan=math.inf).max().item() if got.numel() else 0.0
            tol = 5e-2 * max(1.0, want.abs().max().item())
            if got.shape != want.shape or not err <= tol:
                raise ValueError(f"output differs from the current config's by {err:.3g} (> {tol:.3g})")
            return float(do_bench(run, warmup=warmup_ms, rep=rep_ms, return_mode="median")) * 1e3

    return time_config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ragattn.bench.tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("--device", default="cuda", help="the GPU to tune (default cuda: the current one)")
    parser.add_argument("--keys", nargs="*", default=None,
                        help="shape classes to tune (default: the benchmark's; with --full every class)")
    parser.add_argument("--full", action="store_true", help="sweep the whole space nearest-first, not the quick list")
    parser.add_argument("--out", default=None, help="folder of the tables to write (default: the committed ones)")
    parser.add_argument("--max-candidates", type=int, default=None, help="time at most N candidates per class")
    parser.add_argument("--budget-s", type=float, default=60.0,
                        help="seconds of timing for the whole family (0: no limit; default 60)")
    parser.add_argument("--warmup-ms", type=int, default=10)
    parser.add_argument("--rep-ms", type=int, default=40)
    parser.add_argument("--list", "--dry-run", dest="list", action="store_true",
                        help="print the shape classes and the configs it would time, tune nothing")
    args = parser.parse_args(argv)
    family = FAMILIES[args.family]
    keys = args.keys or list(family.keys if args.full else family.quick_keys)
    for key in keys:
        family.candidates(key)  # a malformed key fails here, before any GPU work
    device = torch.device(args.device)
    gpu = device.type == "cuda" and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    name = torch.cuda.get_device_name(device) if gpu else REFERENCE_GPU

    def candidates(key):
        return family.candidates(key) if args.full else family.quick_candidates(key, name)

    if args.list:
        for key in keys:
            cands = candidates(key)[:args.max_candidates or None]
            mode = "full sweep, nearest first" if args.full else f"quick: the current config for {name!r} first"
            print(f"{family.name} {key}: {len(cands)} candidates ({mode})")
            for c in cands:
                print(f"  {c}")
        return 0
    if not gpu:
        why = ("no CUDA GPU is available here" if not torch.cuda.is_available() else
               f"--device {args.device} is not a GPU" if device.type != "cuda" else "TRITON_INTERPRET=1 is set")
        print(f"ragattn.bench.tune: refusing to tune on this machine ({why}): it times configs on the GPU at hand, "
              f"and a CPU or interpreter timing says nothing about one. Use --list to see the sweep.", file=sys.stderr)
        return 2

    from ragattn.triton_kernels import gpu_configs

    from .provenance import project_commit

    if device.index is not None:  # "cuda" alone: the current device
        torch.cuda.set_device(device)
    t0 = time.monotonic()
    results = tune_family(family, keys, _gpu_timer(family, device, args.warmup_ms, args.rep_ms),
                          max_candidates=args.max_candidates, candidates=candidates,
                          budget_s=args.budget_s or None)
    print(results_table(family.name, results))
    print(f"{family.name}: {sum(r['tried'] for r in results.values())} configs timed in {time.monotonic() - t0:.0f} s")
    if not results:
        print("ragattn.bench.tune: nothing to write", file=sys.stderr)
        return 1
    path = gpu_configs.write_entry(family.name, name, {k: r["config"] for k, r in results.items()},
                                   source_text(name, project_commit(), results), folder=args.out)
    print(f"wrote {len(results)} shape classes for {name!r} to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
