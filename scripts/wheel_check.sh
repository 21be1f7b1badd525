#!/usr/bin/env bash
# Build ragattn's wheel and install it into a fresh virtualenv next to another package that owns
# a top-level `triton_kernels` (vLLM and SGLang import OpenAI's; `triton-kernels` on PyPI stands in
# for it here). Both must import, ragattn's Triton kernels must run from inside the package, and
# the `ragattn` console script and `ragattn bench` must work from the installed wheel.
#   bash scripts/wheel_check.sh          # uses .venv/bin/python to build (torch must be there)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
PY=${PYTHON:-.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "wheel_check: building the wheel"
MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$tmp/dist" . 2>&1 \
  | grep -v "^WARNING: Location" || true
# the in-tree build leaves ragattn.egg-info in the checkout: a process started there would read its
# entry points instead of the installed ones (e.g. vLLM's platform plugin), stale after any edit
rm -rf ragattn.egg-info
whl=$(ls "$tmp"/dist/ragattn-*.whl)
echo "wheel_check: $(basename "$whl")"

# What the wheel holds: only the ragattn package and its metadata, nothing top-level beside it.
"$PY" - "$whl" "$root" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
tops = {n.split("/")[0] for n in names}
bad = sorted(t for t in tops if t != "ragattn" and not t.startswith("ragattn-"))
assert not bad, f"wheel installs top-level names beside ragattn: {bad}"
need = ["ragattn/triton_kernels/paged_attention.py", "ragattn/bench/__main__.py",
        "ragattn/data/qa/questions.jsonl", "ragattn/py.typed"]
# the GPU config tables (the Triton ops refuse to run on a GPU without them) and every bench sub-package
import pathlib
root = pathlib.Path(sys.argv[2])
need += [f"ragattn/triton_kernels/configs/{p.name}" for p in sorted((root / "triton_kernels/configs").glob("*.json"))]
need += [f"ragattn/bench/sm90/{p.name}" for p in sorted((root / "bench/sm90").glob("*.py"))]
# the trained adapters (ragattn.hf.adapters: the block methods load them by default) with their manifests
need += [str(p.relative_to(root)) for p in sorted((root / "ragattn/weights").rglob("*")) if p.is_file()]
assert any(n.startswith("ragattn/triton_kernels/configs/") for n in need), "no config tables in the checkout?"
missing = [n for n in need if n not in names]
assert not missing, f"wheel lacks {missing}"
tests_in = [n for n in names if n.rsplit("/", 1)[-1].startswith(("test_", "conftest"))]
assert not tests_in, f"wheel ships tests: {tests_in}"
assert any(n.startswith("ragattn/_C") and n.endswith(".so") for n in names), "wheel lacks ragattn/_C*.so"
meta = [n for n in names if n.endswith(".dist-info/METADATA")][0]
text = zipfile.ZipFile(sys.argv[1]).read(meta).decode()
for field in ("Requires-Dist: torch", "License-Expression: Apache-2.0", "Provides-Extra: hf",
              "Description-Content-Type: text/markdown"):
    assert field in text, f"METADATA lacks {field!r}"
assert any(n.endswith("licenses/LICENSE") for n in names), "wheel lacks the LICENSE"
ep = [n for n in names if n.endswith("entry_points.txt")]
assert ep and "ragattn = ragattn.__main__:main" in zipfile.ZipFile(sys.argv[1]).read(ep[0]).decode()
print(f"wheel_check: {len(names)} files, only ragattn/ at the top, metadata, LICENSE and the GPU config tables present")
EOF

echo "wheel_check: fresh virtualenv with ragattn and a top-level triton_kernels"
"$PY" -m venv "$tmp/venv"
# --no-compile: a throw-away environment, whose checks import a few modules of the thousands pip would byte-compile
"$tmp/venv/bin/python" -m pip install -q --no-compile "$whl" "numpy<2.4" 2>&1 | grep -v "^WARNING: Location" || true
"$tmp/venv/bin/python" -m pip install -q --no-compile --no-deps "triton-kernels==0.1.0" 2>&1 | grep -v "^WARNING: Location" || true

cd "$tmp"  # away from the checkout, so nothing resolves to its folders
TRITON_INTERPRET=1 RAGATTN_CPU_BACKEND=triton "$tmp/venv/bin/python" - "$root" <<'EOF'
import os, sys
import torch
import triton_kernels                       # the other package's top-level module
import ragattn
from ragattn.triton_kernels import merge_attention_states as mas
site = os.path.dirname(os.path.dirname(ragattn.__file__))
assert not ragattn.__file__.startswith(sys.argv[1]), f"ragattn imported from the checkout: {ragattn.__file__}"
assert os.path.dirname(triton_kernels.__file__) == os.path.join(site, "triton_kernels"), triton_kernels.__file__
assert mas.__file__.startswith(os.path.join(site, "ragattn")), mas.__file__
# a Triton-backed op through the installed kernels (interpreter on the CPU)
a, b = torch.randn(5, 3, 64), torch.randn(5, 3, 64)
la, lb = torch.randn(5, 3), torch.randn(5, 3)
out, lse = ragattn.merge_attention_states(a, la, b, lb)
w = torch.sigmoid(la - lb)[..., None]
torch.testing.assert_close(out, w * a + (1 - w) * b, atol=1e-5, rtol=1e-5)
from ragattn.triton_kernels import gpu_configs
tables = sorted(f for f in os.listdir(gpu_configs.CONFIG_DIR) if f.endswith(".json"))
assert gpu_configs.CONFIG_DIR.startswith(os.path.join(site, "ragattn")) and tables, (gpu_configs.CONFIG_DIR, tables)
print(f"wheel_check: ragattn {ragattn.__version__} and triton_kernels ({triton_kernels.__file__}) side by side; "
      f"an op ran through ragattn.triton_kernels; config tables installed: {', '.join(tables)}")
EOF
"$tmp/venv/bin/ragattn" --help >/dev/null
"$tmp/venv/bin/ragattn" bench sm90 --help | grep -q "^usage: ragattn bench sm90"
TRITON_INTERPRET=1 "$tmp/venv/bin/ragattn" bench --only merge_attention_states --out "$tmp/bench" 2>&1 | tail -n 5
test -s "$tmp/bench/results.json"
echo "wheel_check: passed"
