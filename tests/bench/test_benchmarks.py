"""Every ``bench/bench_*.py`` case as a pytest-benchmark test (CPU sizes unless --device cuda).

Run with ``pytest tests/bench --benchmark-enable`` to get timings; the default run (benchmarks
disabled) executes each case once, so the suite stays runnable.
"""
import pytest
import torch

from bench.harness import collect_cases, synchronize

_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_CASES = collect_cases(_DEVICE, "cpu")


def _synced(fn):
    """``fn`` then a device synchronisation: CUDA launches are asynchronous, and a timing that
    stops at the launch measures the launch, not the kernel."""
    def run():
        out = fn()
        synchronize(_DEVICE)
        return out

    return run


@pytest.mark.parametrize("case", _CASES, ids=[f"{c.family}-{c.name}" for c in _CASES])
def test_bench_ragattn(benchmark, case):
    benchmark(_synced(case.run))


@pytest.mark.parametrize(
    "case,baseline",
    [(c, b) for c in _CASES for b in c.baselines],
    ids=[f"{c.family}-{c.name}-{b}" for c in _CASES for b in c.baselines],
)
def test_bench_baseline(benchmark, case, baseline):
    benchmark(_synced(case.baselines[baseline]))


def test_only_builds_the_named_family(monkeypatch):
    """``--only kv_cache`` must not build (allocate, warn about) any other family's cases."""
    import importlib

    from bench import harness

    built = []
    for name in harness.discover_modules():
        mod = importlib.import_module(name)
        monkeypatch.setattr(mod, "cases", lambda device, size, _n=name, _f=mod.cases: built.append(_n) or _f(device, size))
    cases = harness.collect_cases(torch.device("cpu"), "cpu", only="kv_cache")
    assert cases and {c.family for c in cases} == {"kv_cache"}
    assert built == [n for n in built if n.endswith("bench_kv_cache")] and len(built) == 1
    built.clear()
    # a case-name prefix still works (every module is built and filtered)
    assert {c.family for c in harness.collect_cases(torch.device("cpu"), "cpu", only="copy_kv_")} == {"kv_cache"}


def test_small_cases_take_the_gpu_dtype_on_a_gpu(monkeypatch):
    """On CUDA the small cases (what ``pytest tests/bench`` and the CUDA test stage run) use
    the GPU's bfloat16, not the CPU's float32: every module takes the dtype of its small cases from
    ``harness.small_dtype``, checked here by giving it the GPU's answer on the CPU (the two modules
    whose small cases take seconds to build only show that they ask it)."""
    import importlib

    from bench import harness

    assert harness.small_dtype(torch.device("cuda")) == torch.bfloat16
    assert harness.small_dtype(torch.device("cpu")) == torch.float32

    class Asked(Exception):
        pass

    def ask(device):
        raise Asked

    slow = ("bench_chunk_store", "bench_varlen_attention")
    dtypes = {}
    for name in harness.discover_modules():
        mod = importlib.import_module(name)
        if name.endswith(slow):
            monkeypatch.setattr(mod, "small_dtype", ask)
            with pytest.raises(Asked):
                [c for spec in mod.cases(torch.device("cpu"), "cpu") for c in spec.build_all()]
            continue
        monkeypatch.setattr(mod, "small_dtype", lambda device: torch.bfloat16, raising=False)
        for c in (c for spec in mod.cases(torch.device("cpu"), "cpu") for c in spec.build_all()):
            dtypes[f"{c.family}/{c.name}"] = c.params.get("dtype", c.params.get("logits"))
    # the fp8 cases' dtype is their cache format (float8 on every device), named in the case
    assert len(dtypes) >= 8 and all(d == "bfloat16" or (" fp8 " in n and d.startswith("float8"))
                                    for n, d in dtypes.items()), dtypes


def test_kernel_ab_dry_run(tmp_path):
    """``AB_DRY=1 python scripts/ab_kernels.py OUT``: every variant of the GPU A/B runs at tiny sizes
    in the interpreter and leaves one row without an error (the script a lent GPU runs first)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "ab.jsonl"
    env = dict(os.environ, AB_DRY="1", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "scripts/ab_kernels.py", str(out)], env=env, capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 43 and not [r for r in rows if "error" in r], rows
    assert {r["case"] for r in rows} == {"decode_b32_ctx32768", "decode_window4096", "varlen_chunks8x4096+50",
                                         "varlen_window4096_L16384", "key_attention_scores_q64_k32768",
                                         "verify_draft_B64_g10_V128256_eta0", "verify_draft_B64_g10_V128256_eta10"}
    assert all(r["same_tokens_as_default"] for r in rows if r["case"].startswith("verify_draft"))
