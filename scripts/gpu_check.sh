#!/usr/bin/env bash
# One-call GPU check (run on a machine with CUDA, e.g. through the device tool):
#   bash scripts/gpu_check.sh OUT_DIR
# 1. builds the CUDA extension (sm_90a) in place with the machine's torch,
# 2. runs the whole test suite on CUDA tensors (--device cuda),
# 3. runs the micro-benchmark suite at GPU sizes,
# 4. runs the end-to-end TTFT benchmark on a Llama-3-8B-shaped random bf16 model (4K..32K tokens),
# and writes pytest's log and the benchmark results (JSON + markdown + plot) into OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
t0=$(date +%s)

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git rev-parse HEAD 2>/dev/null; } | tee "$OUT/env.txt"

echo "== build (CUDA extension)"
MAX_JOBS=${MAX_JOBS:-16} $PY -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -20 | tee "$OUT/build.log"
$PY -c "import ragattn" || { echo "build failed"; exit 1; }

echo "== tests on CUDA"
$PY -m pytest -q --device cuda -p no:cacheprovider --timeout=600 2>&1 | tee "$OUT/pytest.log" | tail -40
test_rc=${PIPESTATUS[0]}

echo "== benchmarks at GPU sizes"
$PY -m bench --device cuda --sizes gpu --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -80
bench_rc=${PIPESTATUS[0]}

echo "== end-to-end TTFT (Llama-3-8B shape, random bf16 weights)"
$PY -m bench.e2e --device cuda --model llama3-8b-random --out "$OUT/e2e" 2>&1 | tee "$OUT/e2e.log" | tail -30
e2e_rc=${PIPESTATUS[0]}

echo "gpu_check: tests exit $test_rc, bench exit $bench_rc, e2e exit $e2e_rc, $(( $(date +%s) - t0 )) s"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$e2e_rc" -eq 0 ]
