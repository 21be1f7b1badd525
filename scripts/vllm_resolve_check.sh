#!/usr/bin/env bash
# Does `pip install "ragattn[vllm]"` resolve? vLLM 0.33 pins torch==2.14.0 (whose Linux wheels pin
# triton 3.8), so ragattn's own torch and triton ranges must admit them. A resolver run only: uv's
# resolver reads PyPI's metadata files (PEP 658) and never downloads the wheels themselves (pip's
# --dry-run downloaded 5.3 GB of torch/vllm/nvidia wheels here for the same question), ~10 s and
# ~45 MB of metadata cold. Resolves ragattn's declared requirements (pyproject.toml: dependencies
# + the vllm extra), or a built wheel's with `bash scripts/vllm_resolve_check.sh dist/ragattn-*.whl`.
# Then the newest torch the ranges admit: ragattn's dependencies with torch==$NEWEST_TORCH (2.15.0,
# whose Linux wheels pin triton 3.9) must resolve too (tested: pyproject.toml's comment).
#   bash scripts/vllm_resolve_check.sh [WHEEL]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)

# uv from PyPI in a throwaway virtualenv (uv on PATH is used when present)
UV=$(command -v uv || true)
if [ -z "$UV" ]; then
  "$PYTHON" -m venv "$tmp/venv"
  "$tmp/venv/bin/python" -m pip install -q "uv>=0.5" 2>&1 | grep -v "^WARNING: Location" || true
  UV="$tmp/venv/bin/uv"
fi

NEWEST_TORCH=${NEWEST_TORCH:-2.15.0}
if [ $# -ge 1 ]; then
  echo "ragattn[vllm] @ file://$(realpath "$1")" > "$tmp/req.txt"
  echo "ragattn @ file://$(realpath "$1")" > "$tmp/newest.txt"
else
  "$PYTHON" - "$root/pyproject.toml" "$tmp/newest.txt" > "$tmp/req.txt" <<'PYEOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["vllm"]))
open(sys.argv[2], "w").write("\n".join(project["dependencies"]) + "\n")
PYEOF
fi
echo "torch==$NEWEST_TORCH" >> "$tmp/newest.txt"
echo "vllm_resolve_check: resolving for CPython 3.11 on x86_64 Linux:"
sed 's/^/  /' "$tmp/req.txt"
UV_CACHE_DIR="$tmp/cache" "$UV" pip compile -q --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --no-header "$tmp/req.txt" -o "$tmp/lock.txt"
for pkg in vllm torch triton; do
  grep -E "^$pkg==" "$tmp/lock.txt" | sed 's/^/vllm_resolve_check: resolved /'
done
grep -qE "^vllm==0\.33\." "$tmp/lock.txt" || { echo "vllm_resolve_check: vllm 0.33 not in the resolution" >&2; exit 1; }
if ! UV_CACHE_DIR="$tmp/cache" "$UV" pip compile -q --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --no-header "$tmp/newest.txt" -o "$tmp/newest-lock.txt"; then
  echo "vllm_resolve_check: ragattn's torch/triton ranges do not admit torch $NEWEST_TORCH and its triton" >&2
  exit 1
fi
grep -E "^(torch|triton)==" "$tmp/newest-lock.txt" | sed 's/^/vllm_resolve_check: newest torch: resolved /'
echo "vllm_resolve_check: ok in $(( $(date +%s) - start )) s ($(du -sh "$tmp/cache" | cut -f1) of metadata)"
