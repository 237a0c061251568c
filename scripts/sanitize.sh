#!/usr/bin/env bash
# compute-sanitizer over one small call of every flash op and backward op on the GPU
# (scripts/sanitize_cases.py): memcheck over all of them; racecheck and synccheck over the CUDA
# extension's Hopper kernels, which share memory between warpgroups and sync on barriers.
# The caching allocator is off so that memcheck sees every buffer's bounds, and so is the eager
# fast path (its replays launch the same kernels; its first-use build would run under the tool).
#   scripts/sanitize.sh [OUT_DIR]   (logs OUT_DIR/sanitize_<tool>.txt; exit 1 on any error)
set -uo pipefail
out=${1:-.}
mkdir -p "$out"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 TORCH_FLASH_FAST=0 TORCH_FLASH_AUTOTUNE=0
status=0
run() {
  local tool=$1
  shift
  compute-sanitizer --tool "$tool" --error-exitcode 99 python3 scripts/sanitize_cases.py "$@" \
    > "$out/sanitize_$tool.txt" 2>&1
  local rc=$?
  echo "== $tool: exit $rc"
  grep -E "ERROR SUMMARY|FAILED|ran \(" "$out/sanitize_$tool.txt" | tail -40
  [ "$rc" = 0 ] || status=1
}
run memcheck
run racecheck --only attention_fwd_sm90,attention_bwd_sm90
run synccheck --only attention_fwd_sm90,attention_bwd_sm90
exit $status
