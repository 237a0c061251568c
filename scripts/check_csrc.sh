#!/usr/bin/env bash
# Compile-check the CUDA extension's sources on a machine without a GPU (and without a CUDA
# build of torch): each .cu is compiled with nvcc, each .cpp syntax-checked with the host
# compiler, with the flags, macros and include dirs of the real build (torch_flash/_build.py)
# plus torch's headers. Needs nvcc (CUDA_HOME, PATH or /usr/local/cuda) and nvidia-cutlass
# (pip install nvidia-cutlass). Objects are thrown away.
#
# Not part of CI: CUTLASS kernels take minutes each on 2 cores. Run it by hand before a GPU
# session. The CPU torch wheel lacks c10/cuda/impl/cuda_cmake_macros.h (a stub stands in)
# and the CUDA toolkit here may lack cuBLAS/cuSPARSE headers (ATen/cuda/CUDAContext.h needs
# them: include c10/cuda headers instead).
#
# Usage: scripts/check_csrc.sh [--csrc DIR] [--hdims 64,128] [FILE...]
#   default: every source that FLASH_HDIMS (default 64,128,256) selects
set -uo pipefail
build_py="$(cd "$(dirname "$0")/.." && pwd)/torch_flash/_build.py"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

python "$build_py" --check-commands "$tmp" "$@" > "$tmp/commands" || exit 1
passed=0 failed=0
while IFS=$'\t' read -r src cmd; do
  start=$SECONDS
  if eval "$cmd" < /dev/null > "$tmp/log" 2>&1; then
    echo "ok    $src ($((SECONDS - start)) s)"
    passed=$((passed + 1))
  else
    echo "FAIL  $src ($((SECONDS - start)) s)"
    grep -m 20 -E "error|fatal" "$tmp/log" || tail -n 20 "$tmp/log"
    failed=$((failed + 1))
  fi
done < "$tmp/commands"
echo "check_csrc: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
