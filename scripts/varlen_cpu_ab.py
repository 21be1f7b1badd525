"""One-off A/B, kept for the commands docs/perf/cpu-micro.md records (not part of the benchmark suite).

Interleaved CPU timing of the varlen_attention and key_attention_scores cases against their
same-semantics plain-torch baseline (the ``cases(device, "cpu")`` of bench_varlen_attention and
bench_key_attention_scores): each round calls the op and the baselines once each, so a change of
load on the shared machine moves both; medians over the rounds.

    OMP_NUM_THREADS=1 python scripts/varlen_cpu_ab.py [rounds]

Before/after comparisons: run it from two checkouts alternately (the bench files are the same).
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from ragattn.bench import bench_key_attention_scores, bench_varlen_attention

# baselines that do not compute the op's result (a lower bound, or a different workload)
_NOT_SAME = ("flex_attention", "sdpa_full_causal", "sdpa_causal_prefill")


def main(rounds: int = 300) -> None:
    dev = torch.device("cpu")
    specs = bench_varlen_attention.cases(dev, "cpu") + bench_key_attention_scores.cases(dev, "cpu")
    for case in (c for spec in specs for c in spec.build_all()):
        fns = {"ragattn": case.run, **{k: f for k, f in case.baselines.items() if not k.startswith(_NOT_SAME)}}
        for f in fns.values():
            f()
        samples = {k: [] for k in fns}
        for _ in range(rounds):
            for name, f in fns.items():
                t0 = time.perf_counter()
                f()
                samples[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
        base = min((k for k in med if k != "ragattn"), key=med.get)
        print(f"{case.name:32s} ragattn {med['ragattn']:8.1f} us  {base} {med[base]:8.1f} us  "
              f"speedup {med[base] / med['ragattn']:.2f}x", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
