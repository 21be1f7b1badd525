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
for f in "${files[@]}"; do
  echo "nvcc_check: $f"
  "$NVCC" -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 --expt-relaxed-constexpr -Icsrc -c "$f" -o "$tmp/$(basename "$f").o"
done
echo "nvcc_check: ${#files[@]} kernel file(s) compiled for sm_90a"
