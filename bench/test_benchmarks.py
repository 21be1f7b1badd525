"""Every ``bench/bench_*.py`` case as a pytest-benchmark test (CPU sizes unless --device cuda).

Run with ``pytest bench --benchmark-enable`` to get timings; the default run (benchmarks
disabled) executes each case once, so the suite stays runnable.
"""
import pytest
import torch

from .harness import collect_cases

_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_CASES = collect_cases(_DEVICE, "cpu")


@pytest.mark.parametrize("case", _CASES, ids=[f"{c.family}-{c.name}" for c in _CASES])
def test_bench_ragattn(benchmark, case):
    benchmark(case.run)


@pytest.mark.parametrize(
    "case,baseline",
    [(c, b) for c in _CASES for b in c.baselines],
    ids=[f"{c.family}-{c.name}-{b}" for c in _CASES for b in c.baselines],
)
def test_bench_baseline(benchmark, case, baseline):
    benchmark(case.baselines[baseline])
