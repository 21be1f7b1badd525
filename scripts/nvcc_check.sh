#!/usr/bin/env bash
# Compile-check every framework-free CUDA kernel file (csrc/**/*_kernels.cu) for sm_90a with nvcc
# alone (no torch headers). Skips with a message when nvcc is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-$(command -v nvcc || true)}
if [ -z "$NVCC" ]; then
  echo "nvcc_check: nvcc not found, skipping the CUDA compile check"
  exit 0
fi
mapfile -t files < <(find csrc -name '*_kernels.cu' | sort)
if [ ${#files[@]} -eq 0 ]; then
  echo "nvcc_check: no *_kernels.cu files"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Each file is one nvcc process: up to NVCC_JOBS (default: the core count) run at once, and the
# check fails if any of them does.
JOBS=${NVCC_JOBS:-$(nproc)}
pids=()
wait_all() {
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  pids=()
  return $rc
}
compile() {  # compile FILE ARGS...: in the background, at most JOBS at once
  if [ ${#pids[@]} -ge "$JOBS" ]; then wait_all; fi
  "$NVCC" "${@:2}" -c "$1" -o "$tmp/$(basename "$1").o" &
  pids+=($!)
}
for f in "${files[@]}"; do
  echo "nvcc_check: $f"
  compile "$f" -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 --expt-relaxed-constexpr -Icsrc
done
wait_all
echo "nvcc_check: ${#files[@]} kernel file(s) compiled for sm_90a"

# ATen launchers (csrc/**/*_cuda.cu) against the installed torch's headers, with torch's own nvcc
# flags (C++20, as torch's BuildExtension gives nvcc: C++17 made c10's headers warn in every file).
# A CPU-only torch wheel ships the c10/cuda headers but not the generated cuda_cmake_macros.h: a
# one-line shim stands in for it. Skipped when torch is not importable.
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
mapfile -t launchers < <(find csrc -name '*_cuda.cu' | sort)
if [ ${#launchers[@]} -gt 0 ] && "$PYTHON" -c "import torch" 2>/dev/null; then
  mapfile -t torch_inc < <("$PYTHON" -c "import sysconfig; from torch.utils.cpp_extension import include_paths; print('\n'.join(include_paths() + [sysconfig.get_paths()['include']]))")
  inc_flags=()
  for d in "${torch_inc[@]}"; do inc_flags+=("-I$d"); done
  mkdir -p "$tmp/shim/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$tmp/shim/c10/cuda/impl/cuda_cmake_macros.h"
  for f in "${launchers[@]}"; do
    echo "nvcc_check: $f (against torch headers)"
    compile "$f" -gencode=arch=compute_90a,code=sm_90a -std=c++20 -O3 --expt-relaxed-constexpr \
      -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
      -D__CUDA_NO_HALF2_OPERATORS__ -DRAGATTN_WITH_CUDA=1 -Icsrc "${inc_flags[@]}" -I"$tmp/shim" \
      -diag-suppress=20012,20014 -Xcompiler -Wno-c++20-extensions
  done
  wait_all
  echo "nvcc_check: ${#launchers[@]} launcher file(s) compiled against torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
else
  echo "nvcc_check: torch not importable with $PYTHON (or no *_cuda.cu): launcher check skipped"
fi
