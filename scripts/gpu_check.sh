#!/usr/bin/env bash
# A lent GPU's 15 minutes in two prepared calls of the device tool (each one command of <= 10 min):
#   bash scripts/gpu_check.sh --call 1 OUT_DIR     build (background) + peaks, the GPU rows, twin tests, e2e 32K
#   bash scripts/gpu_check.sh --call 2 OUT_DIR     the A/B if call 1 cut it, the op tests on CUDA, then whatever call 1 cut
#   bash scripts/gpu_check.sh OUT_DIR STAGE ...    chosen stages (below), in the order given
#   bash scripts/gpu_check.sh --plan [--call N | STAGE ...]   print each step and its cap; run nothing (--plan alone: both calls)
#   bash scripts/gpu_check.sh --stamp              write .gpu_check_commit (see "commit" below)
# OUT_DIR is required (what the device tool brings back is what the script leaves there). The device
# tool returns at most 8 files, so OUT_DIR holds only: summary.md (one row a step), env.txt,
# results.jsonl (every benchmark row, appended as it is measured), bench.md (the table of those rows),
# e2e.json, and logs.tgz (every step's log and output, re-packed after each step). The work itself
# happens in WORK_DIR (default /tmp/ragattn_gpu_check), which a warm machine keeps between the calls;
# RESUME_FROM=FILE seeds its results.jsonl from call 1's (carried back in the tree) when the second
# call lands on a fresh machine, so that call 2 re-measures nothing call 1 measured.
#
# Stages:
#   build       build the extension in place (TORCH_CUDA_ARCH_LIST=9.0a, every core) in the background
#               while the peaks (copy, bf16 matmul: pure torch) are measured, then wait for it; fail if
#               the CUDA kernels are missing. Skipped when the extension already has them for these
#               sources (a warm machine's second call). A failed build stops the run.
#   bench-core  paged_attention (decode, window, tagged decode, sparse prefill) and varlen_attention
#               (block prefill, its backward, window): one process per family
#   bench-targets  key_attention_scores q64 x k32K and verify_draft B64 g10 V128256 (eta 0 and 10)
#   twin        the CUDA-vs-CPU-twin tests (verify_draft, fp8 copy/rotate)
#   e2e         end-to-end TTFT on a Llama-3-8B-shaped random bf16 model at 32K tokens
#   ab          the kernel variants' A/B (scripts/ab_kernels.py: key_attention_scores' pass-2 designs,
#               verify_draft's phase-1 groups at eta 0 and its eta 10, tagged RoPE decode, window-decode
#               splits and loops/stages, varlen tiles and TMA) and the tagged-table op tests on CUDA
#               (WORK_DIR/ab/ab.jsonl)
#   bench-rest  every benchmark not measured yet (--resume over results.jsonl)
#   test-ops    the op tests on CUDA tensors (pytest-xdist where it imports)
#   tune        bench.tune for paged_attention and varlen_attention (tables written to WORK_DIR/tune)
#   test-rest   every other test on CUDA (not in either call: give it its own command)
# Without a CUDA device the script says so at once and runs nothing (--plan works anywhere).
# Every step runs under `timeout` with its share of the call's deadline (DEADLINE_S: 450 s for call
# 1, 240 s for call 2, 300 s for chosen stages: both calls and two machine start-ups of ~90 s fit
# 15 minutes), keeping a floor for the steps after it, so a call cut at its deadline keeps
# everything before the cut; STAGE_TIMEOUT caps every step on top of that.
# Commit: RAGATTN_COMMIT if set, else `git rev-parse HEAD`, else the file .gpu_check_commit that
# `--stamp` writes, else "unknown (no .git)"; exported as RAGATTN_COMMIT for the benchmarks.
set -uo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."

usage() {
  echo "usage: gpu_check.sh [--plan] --call 1|2 OUT_DIR | gpu_check.sh [--plan] OUT_DIR STAGE ... | gpu_check.sh --stamp" >&2
  echo "stages: build bench-core bench-targets twin e2e ab bench-rest test-ops tune test-rest" >&2
  exit 2
}

commit_of_tree() {
  if [ -n "${RAGATTN_COMMIT:-}" ]; then echo "$RAGATTN_COMMIT"; return; fi
  local c
  if c=$(git rev-parse HEAD 2>/dev/null); then
    [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && c="$c (uncommitted changes)"
    echo "$c"; return
  fi
  if [ -s .gpu_check_commit ]; then head -1 .gpu_check_commit; return; fi
  echo "unknown (no .git)"
}

if [ "${1:-}" = "--stamp" ]; then
  unset RAGATTN_COMMIT
  c=$(commit_of_tree)
  echo "$c" > .gpu_check_commit
  echo "gpu_check: .gpu_check_commit <- $c"
  exit 0
fi

# The project's environment: .venv where setup.sh made one, else python3 (the GPU image's).
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi

build_check() {
  $PY - <<'EOF'
import torch, ragattn
from ragattn import _extension   # (NATIVE_CUDA_OPS: the CUDA kernels the build registered, not the reference fallback)
missing = [op for op in _extension.CUDA_CPP_OPS if op not in _extension.NATIVE_CUDA_OPS]
assert torch.cuda.is_available(), "no CUDA device"
assert not missing, f"the extension has no CUDA kernels for {missing}: it was built CPU-only"
print("build: CUDA kernels registered for every C++ op")
EOF
}

WORK=${WORK_DIR:-/tmp/ragattn_gpu_check}
sources_stamp() { cat setup.py $(find csrc -type f | sort) | sha1sum | cut -c1-16; }

build() {  # a warm machine's second call keeps the first call's build of the same sources
  if [ -s "$WORK/built" ] && [ "$(cat "$WORK/built")" = "$(sources_stamp)" ] && build_check > /dev/null 2>&1; then
    echo "build: the extension is already built from these sources with its CUDA kernels (kept)"; return 0
  fi
  MAX_JOBS=${MAX_JOBS:-$(nproc)} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} \
    $PY -m pip install -q --no-build-isolation --no-deps -e . && build_check && mkdir -p "$WORK" && sources_stamp > "$WORK/built"
}

if [ "${1:-}" = "--build-only" ]; then build; exit $?; fi

PLAN=0
CALL=""
while [ $# -gt 0 ]; do
  case "$1" in
    --plan) PLAN=1; shift ;;
    --call) CALL=${2:-}; shift 2 || usage ;;
    --*) usage ;;
    *) break ;;
  esac
done
if [ "$PLAN" = 1 ] && [ -z "$CALL" ] && [ $# -eq 0 ]; then   # --plan alone: both calls' plans
  for c in 1 2; do echo "gpu_check: plan of --call $c"; bash "$SELF" --plan --call "$c" || exit $?; done
  exit 0
fi
case "$CALL" in
  1) STAGES=(build bench-core bench-targets twin e2e ab bench-rest); DEADLINE=${DEADLINE_S:-450} ;;
  2) STAGES=(build ab test-ops bench-rest); DEADLINE=${DEADLINE_S:-240} ;;
  "") STAGES=(); DEADLINE=${DEADLINE_S:-300} ;;
  *) echo "gpu_check: --call takes 1 or 2, got $CALL" >&2; usage ;;
esac
if [ $# -eq 0 ]; then
  [ "$PLAN" = 1 ] || { echo "gpu_check: OUT_DIR is required (the folder the device tool brings back)" >&2; usage; }
  OUT=$(mktemp -d)   # --plan without OUT_DIR: the plan is printed, nothing kept
else
  OUT=$1; shift
fi
if [ -n "$CALL" ] && [ $# -gt 0 ]; then echo "gpu_check: --call $CALL takes no stages" >&2; usage; fi
[ ${#STAGES[@]} -eq 0 ] && STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && { echo "gpu_check: name --call 1, --call 2 or the stages to run" >&2; usage; }
for s in "${STAGES[@]}"; do
  case "$s" in build|bench-core|bench-targets|twin|e2e|ab|bench-rest|test-ops|tune|test-rest) ;;
    *) echo "gpu_check: unknown stage $s" >&2; usage ;; esac
done
if [ "$PLAN" = 0 ] && ! { command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L > /dev/null 2>&1; }; then
  echo "gpu_check: no CUDA device here (nvidia-smi finds none): nothing to run. --plan prints the steps." >&2
  exit 3
fi

WORKERS=${TEST_WORKERS:-$(n=$(nproc); [ "$n" -gt 16 ] && n=16; [ "$n" -gt 4 ] && echo $((n - 2)) || echo 2)}
[ "$PLAN" = 1 ] && WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1
export RAGATTN_COMMIT
RAGATTN_COMMIT=$(commit_of_tree)
mkdir -p "$OUT" "$WORK/logs" "$WORK/bench"
if [ -n "${RESUME_FROM:-}" ] && [ -s "$RESUME_FROM" ] && [ ! -s "$WORK/bench/results.jsonl" ]; then
  cp "$RESUME_FROM" "$WORK/bench/results.jsonl"
fi

OP_TESTS=(tests/ops/test_varlen_attention*.py tests/ops/paged_attention/test_*.py
          tests/ops/test_merge_attention_states.py tests/ops/test_kv_cache*.py tests/ops/test_key_attention_scores.py
          tests/ops/test_verify_draft*.py tests/hf/test_rope_vs_hf.py tests/ops/test_refrag_assemble.py
          tests/ops/test_cpp_error_messages.py tests/ops/test_fuzz_*.py)
HF_CUDA_TESTS=(tests/hf/test_hf_generate.py::test_generate_equals_sdpa_every_cache)   # transformers' offloaded cache
TWIN_TESTS=(tests/ops/test_verify_draft.py::test_cuda_matches_cpu_twin tests/ops/test_kv_cache_fp8.py::test_fp8_cpu_twin_matches_reference_bits)
TAGGED_TESTS=(tests/ops/paged_attention/test_paged_attention_tagged.py tests/ops/paged_attention/test_fuzz_paged_attention_tagged.py)
CORE_FAMILIES=(paged_attention varlen_attention)
TARGETS=q64_k32768,B64_g10_V128256
# Seconds: the most a step may take (CAP) and what is kept free for each step still to come (FLOOR).
# Measured: the H100 at d2a4706 built in 50-59 s and ran the op suite in ~190 s (14 workers); a
# compiled FlexAttention baseline takes ~30 s to compile (three in bench-core, plus its backward).
declare -A CAP=([build]=100 [bench-core]=260 [bench-targets]=70 [twin]=50 [e2e]=120 [ab]=110 [bench-rest]=240
                [test-ops]=200 [tune]=150 [test-rest]=560)
declare -A FLOOR=([build]=60 [bench-core]=90 [bench-targets]=30 [twin]=20 [e2e]=60 [ab]=30 [bench-rest]=20
                  [test-ops]=90 [tune]=30 [test-rest]=60)
FAMILY_FLOOR=60   # bench-core: kept for the second family while the first runs

T0=$(date +%s.%N)
PLAN_CLOCK=0   # --plan: each planned step is taken to use its whole cap (the worst case)
now() { awk -v t0="$T0" -v t="$(date +%s.%N)" -v p="$PLAN_CLOCK" 'BEGIN { printf "%.1f", t - t0 + p }'; }
# min(cap, deadline - elapsed - reserve), at most STAGE_TIMEOUT; the reserve (the floors of the
# steps still to come) is in seconds of a 480 s call, scaled to DEADLINE
share() {  # share CAP RESERVE
  awk -v cap="$1" -v res="$2" -v dl="$DEADLINE" -v el="$(now)" -v st="${STAGE_TIMEOUT:-}" \
    'BEGIN { s = dl - el - res * dl / 480; if (s > cap) s = cap; if (st != "" && s > st + 0) s = st;
             if (s < 0) s = 0; printf "%.1f", s }'
}
enough() { awk -v s="$1" 'BEGIN { exit !(s > 0) }'; }

SUMMARY_ROWS=()
: > "$WORK/summary.txt"
write_summary() {
  { echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ)${CALL:+, call $CALL}"
    echo
    echo "- commit: $RAGATTN_COMMIT"
    echo "- gpu: $(head -1 "$WORK/gpu.txt" 2>/dev/null)"
    echo "- $(cat "$WORK/versions.txt" 2>/dev/null)"
    if [ "$PLAN" = 1 ]; then echo "- deadline: ${DEADLINE} s; plan only, nothing ran (each step counted at its whole cap: $(now) s)"
    else echo "- deadline: ${DEADLINE} s, elapsed $(now) s"; fi
    echo
    echo "| step | result | seconds | cap (s) | last line of its log |"
    echo "|---|---|---|---|---|"
    printf '%s\n' "${SUMMARY_ROWS[@]}"
  } > "$OUT/summary.md"
}
# What comes back: the summary, the rows, the tables, and every log in one archive (<= 8 files).
sync_out() {
  cp "$WORK/env.txt" "$OUT/env.txt" 2>/dev/null
  [ "$PLAN" = 1 ] && return
  [ -f "$WORK/bench/results.jsonl" ] && cp "$WORK/bench/results.jsonl" "$OUT/results.jsonl"
  [ -f "$WORK/bench/results.md" ] && cp "$WORK/bench/results.md" "$OUT/bench.md"
  [ -f "$WORK/e2e/e2e.json" ] && cp "$WORK/e2e/e2e.json" "$OUT/e2e.json"
  [ -f "$WORK/e2e/e2e.partial.json" ] && [ ! -f "$WORK/e2e/e2e.json" ] && cp "$WORK/e2e/e2e.partial.json" "$OUT/e2e.json"
  tar czf "$OUT/logs.tgz" -C "$WORK" --exclude='*.so' . 2>/dev/null
}

# Run one step under `timeout CAP`; log to WORK/logs/<name>.log; add its row to the summary.
failed=()
run_step() {  # run_step NAME CAP COMMAND...
  local name=$1 cap=$2; shift 2
  local t0 rc result last took log="$WORK/logs/$name.log"
  t0=$(now)
  echo "== $name (cap ${cap} s): $*"
  if [ "$PLAN" = 1 ]; then
    PLAN_CLOCK=$(awk -v a="$PLAN_CLOCK" -v b="$cap" 'BEGIN { printf "%.1f", a + b }')
    SUMMARY_ROWS+=("| $name | planned | - | $cap | \`$*\` |"); write_summary; return 0
  fi
  if ! enough "$cap"; then
    rc=124; echo "gpu_check: no time left before the deadline" > "$log"
  else
    timeout --kill-after=10 "$cap" "$@" > "$log" 2>&1
    rc=$?
  fi
  tail -15 "$log"
  case $rc in 0) result=ok ;; 124|137) result="cut at ${cap} s" ;; 5) result="no tests" ;; *) result="failed (exit $rc)" ;; esac
  [ "$rc" -eq 0 ] || failed+=("$name")
  last=$(grep -v '^\s*$' "$log" | tail -1 | tr '|' '/' | cut -c1-160)
  took=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.0f", b - a }')
  SUMMARY_ROWS+=("| $name | $result | $took | $cap | $last |")
  echo "== $name: exit $rc in $took s" | tee -a "$WORK/summary.txt"
  write_summary
  sync_out
  return "$rc"
}

if [ "$PLAN" = 0 ]; then
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"; } > "$WORK/gpu.txt"
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" > "$WORK/versions.txt" 2>/dev/null \
    || echo "torch/triton: not importable by $PY" > "$WORK/versions.txt"
else
  echo "(plan only)" > "$WORK/gpu.txt"; echo "(plan only)" > "$WORK/versions.txt"
fi
{ echo "commit: $RAGATTN_COMMIT"; echo "gpu: $(cat "$WORK/gpu.txt")"; cat "$WORK/versions.txt"
  echo "python: $PY"; echo "cores: $(nproc)"; } > "$WORK/env.txt"

xdist_args() { if $PY -c "import xdist" > /dev/null 2>&1; then echo "-n $WORKERS"; fi; }
bench_cmd() {  # bench_cmd ONLY: one benchmark process appending to WORK/bench/results.jsonl
  echo $PY -m bench --device cuda --sizes gpu --only "$1" --out "$WORK/bench" --peaks "$WORK/peaks.json" --resume
}
reserve_after() {  # the floors of the stages after position $1 in STAGES
  local i=$1 r=0 j
  for ((j = i + 1; j < ${#STAGES[@]}; j++)); do r=$((r + FLOOR[${STAGES[j]}])); done
  echo "$r"
}

for ((i = 0; i < ${#STAGES[@]}; i++)); do
  stage=${STAGES[i]}
  reserve=$(reserve_after "$i")
  case "$stage" in
    build)   # the build in the background, the peaks (pure torch, no extension) meanwhile
      cap=$(share "${CAP[build]}" "$reserve")
      if [ "$PLAN" = 0 ]; then
        ( timeout --kill-after=10 "$cap" bash "$SELF" --build-only > "$WORK/logs/build.log" 2>&1; echo $? > "$WORK/build.rc" ) &
        bg=$!
        run_step peaks "$cap" $PY -c "import torch; from bench.harness import load_peaks; print(load_peaks(torch.device('cuda'), '$WORK/peaks.json'))"
        wait "$bg"
        run_step build "$cap" bash -c "cat '$WORK/logs/build.log'; exit \$(cat '$WORK/build.rc')" \
          || break   # a failed build makes every later stage meaningless
      else
        run_step build "$cap" "bash $SELF --build-only (in the background) + the peaks"
      fi ;;
    bench-core)
      for ((f = 0; f < ${#CORE_FAMILIES[@]}; f++)); do
        fam=${CORE_FAMILIES[f]}
        left=$(( (${#CORE_FAMILIES[@]} - f - 1) * FAMILY_FLOOR ))
        cap=$(share "$(( CAP[bench-core] - f * FAMILY_FLOOR ))" $((reserve + left)))
        run_step "bench-$fam" "$cap" $(bench_cmd "$fam")
      done ;;
    bench-targets)
      run_step bench-targets "$(share "${CAP[bench-targets]}" "$reserve")" $(bench_cmd "$TARGETS") ;;
    twin)
      run_step twin "$(share "${CAP[twin]}" "$reserve")" \
        $PY -m pytest -q -rfE --device cuda -p no:cacheprovider "${TWIN_TESTS[@]}" ;;
    e2e)
      run_step e2e "$(share "${CAP[e2e]}" "$reserve")" \
        $PY -m bench.e2e --device cuda --model llama3-8b-random --sizes gpu-32k --repeats 3 --answer-tokens 16 \
          --memory-requests 0 --out "$WORK/e2e" ;;
    ab)
      mkdir -p "$WORK/ab"
      if [ -f "$WORK/ab/done" ]; then echo "== ab: done by an earlier call (kept)"; continue; fi
      run_step ab "$(share "${CAP[ab]}" "$reserve")" bash -c \
        "AB_PARTS=keys,verify,paged $PY scripts/ab_kernels.py '$WORK/ab/ab.jsonl'; r1=\$?; \
         $PY -m pytest -q -rfE --device cuda -p no:cacheprovider $(xdist_args) ${TAGGED_TESTS[*]}; r2=\$?; \
         AB_PARTS=varlen $PY scripts/ab_kernels.py '$WORK/ab/ab.jsonl'; r3=\$?; \
         [ \$(( r1 | r2 | r3 )) = 0 ] && touch '$WORK/ab/done'; exit \$(( r1 | r2 | r3 ))" ;;
    bench-rest)
      run_step bench-rest "$(share "${CAP[bench-rest]}" "$reserve")" \
        $PY -m bench --device cuda --sizes gpu --out "$WORK/bench" --peaks "$WORK/peaks.json" --resume ;;
    test-ops)
      # shellcheck disable=SC2046
      run_step test-ops "$(share "${CAP[test-ops]}" "$reserve")" \
        $PY -m pytest -v -rfE --device cuda -p no:cacheprovider $(xdist_args) "${OP_TESTS[@]}" "${HF_CUDA_TESTS[@]}" ;;
    tune)
      run_step tune "$(share "${CAP[tune]}" "$reserve")" \
        bash -c "$PY -m bench.tune paged_attention --out '$WORK/tune' && $PY -m bench.tune varlen_attention --out '$WORK/tune'" ;;
    test-rest)
      ignores=()
      for f in "${OP_TESTS[@]}"; do ignores+=(--ignore "$f"); done
      # shellcheck disable=SC2046
      run_step test-rest "$(share "${CAP[test-rest]}" "$reserve")" \
        $PY -m pytest -v -rfE --device cuda -p no:cacheprovider $(xdist_args) "${ignores[@]}" tests ;;
  esac
done
write_summary
sync_out
echo
cat "$OUT/summary.md"
[ "$PLAN" = 1 ] && { echo "gpu_check: plan only, nothing ran"; exit 0; }
[ ${#failed[@]} -eq 0 ] || { echo "gpu_check: failed steps: ${failed[*]}"; exit 1; }
echo "gpu_check: all steps passed"
