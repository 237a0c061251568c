#!/usr/bin/env bash
# One GPU session in one call (the GPU machine has no network and bills by the minute): install
# the carried wheels, the peers (FlashAttention 4, quack) where their first part waits in /tmp
# (see the CuTe DSL split of gpu-peers.sh: its run 1 copies part1 there), the package and, with
# BUILD=1, torch_flash._C (FLASH_HDIMS, default 64,128; KERNEL_OBJECTS=DIR links the kernel
# objects exported there on a CPU machine, see docs/design.md; the built .so also left gzipped
# in $OUT for later calls to carry); report the environment; run the GPU tests, the demo and the
# benchmarks; leave logs and JSON in $OUT.
# Usage: scripts/gpu_session.sh [suite[:seconds] ...]   (seconds: that suite's time limit;
# BENCH_ARGS: more options for every suite, e.g. "--configs fa4,cuda-sm90,flash-op,sdpa-cudnn,triton-det";
# AB_SO: see below)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
export PYTHONUNBUFFERED=1
if ls .wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .wheels/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -f /tmp/part1 ] && [ -f .gpu-peers/b/gpu-peers.sh ]; then
  bash .gpu-peers/b/gpu-peers.sh install &&
    export PYTHONPATH=/tmp/peers:/tmp/peers/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
if [ "${BUILD:-0}" = 1 ]; then
  start=$SECONDS
  python3 -m torch_flash build --hdims "${FLASH_HDIMS:-64,128}" ${KERNEL_OBJECTS:+--objects "$KERNEL_OBJECTS"} \
    > "$OUT/build.txt" 2>&1
  echo "build: exit $?, $((SECONDS - start)) s" | tee -a "$OUT/build.txt"
  gzip -c torch_flash/_C*.so > "$OUT/_C.so.gz" 2>/dev/null
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -m torch_flash info; } 2>&1 | tee "$OUT/info.txt"
[ "${DEMO:-1}" = 0 ] || TORCH_FLASH_AUTOTUNE=0 python3 -m torch_flash demo 2>&1 | tee "$OUT/demo.txt"
if [ -n "${GPU_TESTS:-1}" ] && [ "${GPU_TESTS:-1}" != 0 ]; then
  # the whole log (tracebacks) in tests_full.txt, its summary in tests.txt
  # loadgroup: tests of one xdist_group share a worker (the large-index cases, memory-bound)
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q --dist loadgroup ${PYTEST_ARGS--x} -m cuda ${TESTS:-tests} 2>&1 |
    tee "$OUT/tests_full.txt" | tail -40 | tee "$OUT/tests.txt"
fi
bench() {  # bench OUTDIR SPEC...
  local out=$1; shift
  for spec in "$@"; do
    suite=${spec%%:*}; limit=${spec#*:}; [ "$limit" = "$spec" ] && limit=${BENCH_TIMEOUT:-240}
    # --max-seconds: a minute before the limit no new grid point starts, so the JSON is written
    budget=; [ "$suite" != train ] && [ "$limit" -gt 120 ] && budget="--max-seconds $((limit - 60))"
    timeout "$limit" python3 -m torch_flash.bench "$suite" --out "$out" $budget ${BENCH_ARGS:-} 2>&1 | tee "$out/bench_$suite.txt"
  done
}
bench "$OUT" "$@"
# AB_SO=FILE.so.gz (another build of torch_flash._C, e.g. an earlier call's $OUT/_C.so.gz): the
# same benchmarks again on that build, into $OUT/ab; then this build is put back
if [ -n "${AB_SO:-}" ] && so=$(ls torch_flash/_C*.so 2>/dev/null | head -1) && [ -n "$so" ]; then
  mkdir -p "$OUT/ab" && cp "$so" /tmp/_C.this.so && gunzip -c "$AB_SO" > "$so" && bench "$OUT/ab" "$@"
  cp /tmp/_C.this.so "$so"
fi
