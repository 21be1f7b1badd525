"""``python -m ragattn.bench.tune FAMILY``: sweep a kernel family's launch configurations on the GPU
at hand and write its entry in the config table (``triton_kernels/configs/FAMILY.json``).

    python -m ragattn.bench.tune varlen_attention                    # every 16-bit shape class
    python -m ragattn.bench.tune key_attention_scores --keys 16bit/d128 --out /tmp/configs
    python -m ragattn.bench.tune varlen_attention --list             # the sweep, without a GPU
    python -m ragattn.bench.tune varlen_attention --keys fwd/16bit/d128 fwd/16bit/d128/window \
        --max-candidates 24                                          # a short lease: the nearest 24

For each shape class the family names, every candidate config (tiles, warps, stages, ...) is run
through the real launcher (``gpu_configs.override``) on a representative problem, its output checked
against the table's current config, and timed with ``triton.testing.do_bench`` (median, L2
flushed); candidates that fail to compile or launch (shared memory, registers) are skipped. The
fastest is written under the device's ``torch.cuda.get_device_name``, with the commit, date and
timings in the entry's ``source``. Nothing here runs without a CUDA GPU: on a CPU it refuses (exit
status 2), since a timing in the interpreter says nothing about a GPU.

    python -m ragattn.bench.tune paged_attention --keys decode/16bit/d128 --max-candidates 40
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import math
import os
import sys
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

Config = Dict[str, object]


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
    "key_attention_scores": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, waves=3.0),
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
        return (d, bool(c.get("tma")))

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
    """The sweep of a ``key_attention_scores`` shape class: tiles, warps, stages and the pass-1 wave target."""
    dt, dclass = shape_key.split("/")[:2]
    block_d = int(dclass[1:])
    elt = 4 if dt == "fp32" else 2
    out = []
    for bm, bn, warps, stages, waves in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4), (1.0, 2.0, 3.0, 4.0)):
        if _smem_bytes(bm, bn, block_d, stages, elt, 1) > SMEM_LIMIT:
            continue
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, waves=waves))
    return nearest_first(out, ANCHORS["key_attention_scores"])


def paged_attention_candidates(shape_key: str) -> List[Config]:
    """The sweep of a ``paged_attention`` shape class: the key tile, warps, stages and the split-KV
    wave target (the query tile follows from the rows and the GQA group, so it is not swept)."""
    from ragattn.triton_kernels.paged_attention import SMEM_BUDGET  # over it the launcher shrinks a config

    kind, dt, dclass = shape_key.split("/")[:3]
    block_d = int(dclass[1:])
    elt = 4 if dt == "fp32" else 2
    m_tile = {"decode": 16, "verify": 64, "prefill": 128}[kind]
    out = []
    for bn, warps, stages, waves in itertools.product((16, 32, 64, 128), (2, 4, 8), (2, 3, 4), (2.0, 4.0, 8.0)):
        if kind == "prefill" and waves != 4.0:  # prefill grids fill the GPU without splits
            continue
        if m_tile * bn < 32 * warps * 4 or elt * block_d * (m_tile + 2 * bn * stages) > SMEM_BUDGET:
            continue
        out.append(dict(BLOCK_N=bn, num_warps=warps, num_stages=stages, waves=waves))
    anchor = ANCHORS["paged_decode" if kind != "prefill" else "paged_prefill"]
    return nearest_first([dict(c, BLOCK_M=anchor["BLOCK_M"]) for c in out], anchor)


def sweep(candidates: Iterable[Config], time_config: Callable[[Config], float],
          log: Callable[[str], None] = lambda s: None) -> Tuple[Optional[Config], List[Tuple[Config, float]]]:
    """Time every candidate (``time_config`` returns microseconds, or raises when the candidate
    cannot run or computes a wrong result: it is skipped); returns (the fastest, every timing).
    Ties keep the earlier candidate (the sweep's order is deterministic)."""
    best, best_us, timings = None, math.inf, []
    for cfg in candidates:
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


def tune_family(family: "Family", keys: List[str], time_config: Callable[[str, Config], float],
                log: Callable[[str], None] = print, max_candidates: Optional[int] = None) -> Dict[str, dict]:
    """Sweep each shape key; returns {shape key: {"config": best, "us": its time, "tried": n}}."""
    results = {}
    for key in keys:
        cands = family.candidates(key)
        if max_candidates:
            cands = cands[:max_candidates]
        log(f"{family.name} {key}: {len(cands)} candidates")
        best, timings = sweep(cands, lambda cfg, _k=key: time_config(_k, cfg), log)
        if best is None:
            log(f"{family.name} {key}: no candidate ran; the table keeps its entry")
            continue
        results[key] = dict(config=best, us=min(us for _, us in timings), tried=len(timings))
    return results


def source_text(device_name: str, commit: str, results: Dict[str, dict]) -> str:
    times = ", ".join(f"{k} {r['us']:.1f} us" for k, r in sorted(results.items()))
    return (f"measured by ragattn.bench.tune on {device_name}, commit {commit}, "
            f"{datetime.date.today().isoformat()} (do_bench median; {times})")


# ---------------------------------------------------------------------------------------------
# The families: shape classes, candidates, a representative problem per class
class Family:
    name: str
    keys: Tuple[str, ...]

    def candidates(self, shape_key: str) -> List[Config]:
        raise NotImplementedError

    def problem(self, shape_key: str, device: torch.device) -> Callable[[], object]:
        """A call of the op at a representative shape of the class (the launcher reads the table)."""
        raise NotImplementedError


class VarlenFamily(Family):
    name = "varlen_attention"
    keys = tuple(f"{k}/16bit/{d}{w}" for d in ("d64", "d128", "d256")
                 for k, w in (("fwd", ""), ("fwd", "/window"), ("dq", ""), ("dkdv", "")))

    def candidates(self, shape_key):
        return varlen_candidates(shape_key)

    def problem(self, shape_key, device):
        import ragattn

        kernel, dt, dclass = shape_key.split("/")[:3]
        window = shape_key.endswith("/window")
        d = int(dclass[1:])
        dtype = torch.float32 if dt == "fp32" else torch.bfloat16
        gen = torch.Generator().manual_seed(0)
        n, chunk, tail = (8, 1024, 50)
        L = n * chunk + tail
        q = torch.randn(L, 32, d, generator=gen).to(device=device, dtype=dtype)
        k = torch.randn(L, 8, d, generator=gen).to(device=device, dtype=dtype)
        v = torch.randn(L, 8, d, generator=gen).to(device=device, dtype=dtype)
        cu = torch.tensor([0, L], dtype=torch.int32, device=device)
        if window:
            return lambda: ragattn.varlen_attention(q, k, v, cu, cu, window_left=2047)[0]
        blk = torch.cat([torch.arange(n).repeat_interleave(chunk), torch.full((tail,), -1)]).to(torch.int32).to(device)
        if kernel == "fwd":
            return lambda: ragattn.varlen_attention(q, k, v, cu, cu, q_block=blk, kv_block=blk)[0]
        out, lse = ragattn.varlen_attention(q, k, v, cu, cu, q_block=blk, kv_block=blk)
        dout = torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype)
        return lambda: torch.ops.ragattn.varlen_attention_backward(
            dout, q, k, v, out, lse, cu, cu, None, None, blk, blk, True, None)[0 if kernel == "dq" else 1]


class KeyScoresFamily(Family):
    name = "key_attention_scores"
    keys = ("16bit/d64", "16bit/d128", "16bit/d256")

    def candidates(self, shape_key):
        return key_attention_scores_candidates(shape_key)

    def problem(self, shape_key, device):
        import ragattn

        dt, dclass = shape_key.split("/")[:2]
        d = int(dclass[1:])
        dtype = torch.float32 if dt == "fp32" else torch.bfloat16
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(64, 32, d, generator=gen).to(device=device, dtype=dtype)
        k = torch.randn(32768, 8, d, generator=gen).to(device=device, dtype=dtype)
        cu_q = torch.tensor([0, 64], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 32768], dtype=torch.int32, device=device)
        return lambda: ragattn.key_attention_scores(q, k, cu_q, cu_k)


class PagedFamily(Family):
    """``paged_attention``: each class is timed on the sum of a few problems of its kind, so one
    config serves the batch sizes and windows a server sees (bf16, 32 query / 8 kv heads, page 16,
    shuffled pages): decode at batch 32 x 32K, batch 4 x 32K and batch 32 x 32K under a 4096 window;
    verify (5-token speculative tails) at batch 32 x 8K; prefill 15% scattered rows of 32K."""
    name = "paged_attention"
    keys = tuple(f"{k}/16bit/{d}" for k in ("decode", "verify", "prefill") for d in ("d64", "d128"))

    def candidates(self, shape_key):
        return paged_attention_candidates(shape_key)

    def problem(self, shape_key, device):
        import ragattn

        kind, dt, dclass = shape_key.split("/")[:3]
        d = int(dclass[1:])
        dtype = torch.float32 if dt == "fp32" else torch.bfloat16
        gen = torch.Generator().manual_seed(0)
        page = 16

        def one(batch, ctx, rows, window=-1):
            pages = -(-ctx // page)
            bt = torch.randperm(batch * pages, generator=gen).view(batch, pages).to(torch.int32).to(device)
            k = torch.randn(batch * pages, page, 8, d, generator=gen).to(device=device, dtype=dtype)
            v = torch.randn(batch * pages, page, 8, d, generator=gen).to(device=device, dtype=dtype)
            if rows == "sparse":
                pos = torch.sort(torch.randperm(ctx, generator=gen)[: int(0.15 * ctx)]).values
            else:
                pos = torch.arange(ctx - rows, ctx).repeat(batch)
            q_pos = pos.to(torch.int32).to(device)
            n = q_pos.numel() // batch
            q = torch.randn(q_pos.numel(), 32, d, generator=gen).to(device=device, dtype=dtype)
            cu = (torch.arange(batch + 1) * n).to(torch.int32).to(device)
            kv_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            table = ragattn.PageTable.from_block_table(bt, kv_lens)

            def run():  # planned from maxima (no host sync) under whatever config is in force
                plan = ragattn.plan_paged_attention(cu, table, num_heads=32, num_kv_heads=8, head_dim=d, dtype=dtype,
                                                    window_left=window, max_q_len=n, max_kv_len=ctx)
                return ragattn.run_paged_attention(plan, q, q_pos, k, v)[0]
            return run

        if kind == "decode":
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
    parser.add_argument("--keys", nargs="*", default=None, help="shape classes to tune (default: the family's list)")
    parser.add_argument("--out", default=None, help="folder of the tables to write (default: the committed ones)")
    parser.add_argument("--max-candidates", type=int, default=None,
                        help="time only the N candidates nearest the anchors per class")
    parser.add_argument("--warmup-ms", type=int, default=10)
    parser.add_argument("--rep-ms", type=int, default=40)
    parser.add_argument("--list", action="store_true", help="print the shape classes and candidates, tune nothing")
    args = parser.parse_args(argv)
    family = FAMILIES[args.family]
    keys = args.keys or list(family.keys)
    for key in keys:
        family.candidates(key)  # a malformed key fails here, before any GPU work
    if args.list:
        for key in keys:
            cands = family.candidates(key)
            print(f"{family.name} {key}: {len(cands)} candidates")
            for c in cands[:args.max_candidates or len(cands)]:
                print(f"  {c}")
        return 0
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        why = "TRITON_INTERPRET=1 is set" if torch.cuda.is_available() else "no CUDA GPU is available here"
        print(f"ragattn.bench.tune: refusing to tune on this machine ({why}): it times configs on the GPU at hand, "
              f"and a CPU or interpreter timing says nothing about one. Use --list to see the sweep.", file=sys.stderr)
        return 2

    from ragattn.triton_kernels import gpu_configs

    from .provenance import project_commit

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    results = tune_family(family, keys, _gpu_timer(family, device, args.warmup_ms, args.rep_ms),
                          max_candidates=args.max_candidates)
    if not results:
        print("ragattn.bench.tune: nothing to write", file=sys.stderr)
        return 1
    path = gpu_configs.write_entry(family.name, name, {k: r["config"] for k, r in results.items()},
                                   source_text(name, project_commit(), results), folder=args.out)
    print(f"wrote {len(results)} shape classes for {name!r} to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
