#!/usr/bin/env bash
# One device call (issue 42, 2026-12-06, a lent H100): the batched decode step at C = 1..16 (engine.bench.concurrency)
# on the 27B hybrid shape in bf16 and int4 at 4K, and C = 1, 4 at 64K; the batched int4 GEMV against the one-row
# one (engine.bench.int4_rows); then the GPU tests the day's changes touch (JUnit). Benches first: they are what
# the call is for; the tests take what time is left. Results in $OUT.
#   bash docs/concurrency_run.sh            (expects the wheels installed: PYTHONPATH set by .whl/gpu.sh's lines)
set -u
OUT=${OUT:-/tmp/concurrency-run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.csv" 2>&1
b() {  # b NAME TIMEOUT MODULE ARGS...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" python3 -m "$@" --out "$OUT/$name.json" > /dev/null 2> "$OUT/$name.err"
  echo "$name: exit $? in $((SECONDS - t0)) s"
}
b conc-bf16-4k 170 engine.bench.concurrency --context 4096 --batches 1,2,4,8,16 --agree 16
b conc-int4-4k 110 engine.bench.concurrency --context 4096 --batches 1,2,4,8,16 --int4
b int4-rows 100 engine.bench.int4_rows --sweep-rows 8
b conc-bf16-64k 80 engine.bench.concurrency --context 65536 --batches 1,4
left=$((560 - SECONDS))
if [ "$left" -gt 30 ]; then
  timeout "$left" python3 -m pytest -q -p no:cacheprovider -m gpu --junitxml="$OUT/gpu-junit.xml" \
    tests/engine/test_engine_int4_gpu.py tests/engine/test_engine_hybrid_gpu.py tests/service/test_service_gpu.py \
    > "$OUT/gpu.log" 2>&1
  echo "gpu tests: exit $?"; tail -5 "$OUT/gpu.log"
fi
