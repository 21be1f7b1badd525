#!/usr/bin/env bash
# What a cold `pip install "ragattn[vllm]"` downloads on Linux x86_64 / CPython 3.11, without
# downloading it: uv locks ragattn's declared requirements (pyproject.toml: dependencies + the vllm
# extra) from PyPI's metadata, and the lock records every file's size; this sums the wheel pip would
# pick for this interpreter (best-ranked tag) per package and lists the largest. A few seconds and
# ~50 MB of metadata. Not run by CI (docs/vllm.md quotes its result).
#   bash scripts/vllm_download_size.sh [TOP]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

UV=$(command -v uv || true)
if [ -z "$UV" ]; then
  "$PYTHON" -m venv "$tmp/venv"
  "$tmp/venv/bin/python" -m pip install -q "uv>=0.5" 2>&1 | grep -v "^WARNING: Location" || true
  UV="$tmp/venv/bin/uv"
fi

mkdir "$tmp/probe"
"$PYTHON" - "$root/pyproject.toml" > "$tmp/probe/pyproject.toml" <<'PYEOF'
import json, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
deps = project["dependencies"] + project["optional-dependencies"]["vllm"]
print('[project]\nname = "ragattn-vllm-probe"\nversion = "0"\nrequires-python = "==3.11.*"')
print("dependencies = " + json.dumps(deps))
print('[tool.uv]\nenvironments = ["sys_platform == \'linux\' and platform_machine == \'x86_64\'"]')
PYEOF
(cd "$tmp/probe" && UV_CACHE_DIR="$tmp/cache" "$UV" lock -q)

"$PYTHON" - "$tmp/probe/uv.lock" "${1:-15}" <<'PYEOF'
import sys, tomllib
from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

lock = tomllib.load(open(sys.argv[1], "rb"))
rank = {str(t): i for i, t in enumerate(sys_tags())}
rows = []
for pkg in lock["package"]:
    if pkg["name"] == "ragattn-vllm-probe":
        continue
    best = None
    for w in pkg.get("wheels", []):
        tags = parse_wheel_filename(w["url"].rsplit("/", 1)[1])[3]
        r = min((rank[str(t)] for t in tags if str(t) in rank), default=None)
        if r is not None and (best is None or r < best[0]):
            best = (r, w.get("size", 0))
    size = best[1] if best else (pkg.get("sdist") or {}).get("size", 0)
    rows.append((size, f"{pkg['name']}=={pkg['version']}", best is None))
rows.sort(reverse=True)
for size, name, sdist in rows[: int(sys.argv[2])]:
    print(f"  {size / 1e6:8.1f} MB  {name}{'  (sdist)' if sdist else ''}")
total = sum(r[0] for r in rows)
print(f"vllm_download_size: {len(rows)} packages, {total / 1e9:.2f} GB of wheels "
      f"(torch and nvidia-*: {sum(r[0] for r in rows if r[1].startswith(('torch==', 'nvidia-'))) / 1e9:.2f} GB)")
PYEOF
