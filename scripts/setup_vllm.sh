#!/usr/bin/env bash
# The vLLM environment: a second virtualenv .venv-vllm with vllm 0.33 (no CUDA: config,
# scheduler and KV-connector API on the CPU) and an editable install of this worktree, for
# ragattn.vllm and tests/vllm (docs/vllm.md). Idempotent: a second run only checks (seconds).
#   bash scripts/setup_vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=.venv-vllm
PY=$VENV/bin/python
# The torch build of the main environment (requirements.txt: the CPU build of 2.13.0), not
# vllm's pin (torch==2.14.0 from PyPI is a CUDA build with several GB of CUDA wheels).
TORCH=$(grep -E '^torch==' requirements.txt | cut -d' ' -f1)
stamp=$VENV/.ragattn-setup-$(cat requirements.txt requirements-vllm.txt setup.py pyproject.toml | sha256sum | cut -c1-16)

if [ ! -x $PY ]; then
  "$PYTHON" -m venv $VENV
fi
if [ ! -f "$stamp" ]; then
  $PY -m pip install -q --upgrade "pip>=25" "setuptools>=77,<86" wheel ninja
  $PY -m pip install -q "$TORCH"
  # --no-deps: see requirements-vllm.txt (vllm's declared set does not resolve)
  $PY -m pip install -q --no-deps -r requirements-vllm.txt
  # The extension built by scripts/setup.sh (in the tree, editable) serves this env too when
  # both have the same torch build; otherwise build it against this env's torch.
  reuse=0
  if ls ragattn/_C*.so >/dev/null 2>&1 && [ -x .venv/bin/python ] && \
     [ "$(.venv/bin/python -c 'import torch; print(torch.__version__, torch.version.cuda)')" = \
       "$($PY -c 'import torch; print(torch.__version__, torch.version.cuda)')" ]; then
    reuse=1
  fi
  RAGATTN_REUSE_EXT=$reuse MAX_JOBS=${MAX_JOBS:-2} $PY -m pip install -q --no-build-isolation --no-deps -e .
  rm -f $VENV/.ragattn-setup-*
  touch "$stamp"
fi
$PY -c "import vllm, torch, ragattn, ragattn.vllm; from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1; print('vllm', vllm.__version__, 'on torch', torch.__version__, '- ragattn', ragattn.__version__, '- ops:', len([n for n in ragattn.__all__ if hasattr(torch.ops.ragattn, n)]))"
