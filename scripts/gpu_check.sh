#!/usr/bin/env bash
# GPU check in stages, each of which fits in one 10-minute command of a lent GPU machine:
#   bash scripts/gpu_check.sh OUT_DIR [STAGE ...]
# Stages (default: all of them, in this order; each is capped at STAGE_TIMEOUT seconds, 570 default):
#   build      build the CUDA extension in place; fail if the CUDA kernels did not get registered
#   test-ops   the op tests on CUDA tensors (--device cuda)
#   test-rest  every other test on CUDA (model tests skip where the model packages are absent)
#   bench      the micro-benchmarks at GPU sizes           -> OUT_DIR/results.{json,md}
#   e2e        end-to-end TTFT on a Llama-3-8B-shaped random bf16 model -> OUT_DIR/e2e/
# Every stage writes its log to OUT_DIR/<stage>.log; the exit code is non-zero if any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_check.sh OUT_DIR [build|test-ops|test-rest|bench|e2e ...]}
shift
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(build test-ops test-rest bench e2e)
mkdir -p "$OUT"
: > "$OUT/summary.txt"
PY=${PYTHON:-python3}
LIMIT=${STAGE_TIMEOUT:-570}
export PYTHONUNBUFFERED=1
OP_TESTS=(tests/test_varlen_attention.py tests/test_paged_attention.py tests/test_merge_attention_states.py
          tests/test_kv_cache.py tests/test_key_attention_scores.py tests/test_verify_draft.py tests/test_rope_vs_hf.py)

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git rev-parse HEAD 2>/dev/null; } > "$OUT/env.txt"

run_stage() {
  local stage=$1
  case "$stage" in
    build)
      MAX_JOBS=${MAX_JOBS:-16} timeout "$LIMIT" $PY -m pip install -q --no-build-isolation --no-deps -e . &&
      $PY - <<'EOF'
import torch, ragattn
from ragattn import _extension   # (NATIVE_CUDA_OPS: the CUDA kernels the build registered, not the reference fallback)
missing = [op for op in _extension.CUDA_CPP_OPS if op not in _extension.NATIVE_CUDA_OPS]
assert torch.cuda.is_available(), "no CUDA device"
assert not missing, f"the extension has no CUDA kernels for {missing}: it was built CPU-only"
print("build: CUDA kernels registered for every C++ op")
EOF
      ;;
    test-ops) timeout "$LIMIT" $PY -m pytest -q --device cuda -p no:cacheprovider "${OP_TESTS[@]}" ;;
    test-rest)
      local ignores=()
      for f in "${OP_TESTS[@]}"; do ignores+=(--ignore "$f"); done
      timeout "$LIMIT" $PY -m pytest -q --device cuda -p no:cacheprovider "${ignores[@]}" ;;
    bench) timeout "$LIMIT" $PY -m bench --device cuda --sizes gpu --out "$OUT" ;;
    e2e) timeout "$LIMIT" $PY -m bench.e2e --device cuda --model llama3-8b-random --out "$OUT/e2e" ;;
    *) echo "gpu_check: unknown stage $stage"; return 2 ;;
  esac
}

failed=()
for stage in "${STAGES[@]}"; do
  t0=$(date +%s)
  echo "== $stage"
  run_stage "$stage" 2>&1 | tee "$OUT/$stage.log" | tail -40
  rc=${PIPESTATUS[0]}
  echo "== $stage: exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || failed+=("$stage")
  # a failed build makes every later stage meaningless
  if [ "$stage" = build ] && [ "$rc" -ne 0 ]; then break; fi
done
[ ${#failed[@]} -eq 0 ] || { echo "gpu_check: failed stages: ${failed[*]}"; exit 1; }
echo "gpu_check: all stages passed"
