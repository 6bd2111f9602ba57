#!/usr/bin/env bash
# One device call (issue 42, a lent H100 or H200): the GPU tests of the batch loop's captured step (graph replays
# equal the padded eager step bit for bit) and of the batched int4 GEMV (every blocks form, stages 1 and 2); the
# batched int4 GEMV against the one-row one (engine.bench.int4_rows, block settings swept at M = 2, 8, 16); then
# the service's batched step at C = 1..16 (engine.bench.concurrency: the graph of each row bucket, and the same
# step launched eagerly, its kernels profiled at C = 8) on the 27B hybrid shape at 4K in bf16 (and with attention
# and the Gated DeltaNet mix in their torch forms, the comparison), then int4 with the engine's routing and with up to 4 rows as
# one-row GEMVs; last, the service through HTTP. The whole script stays
# inside LIMIT seconds (default 540); each part gets what is left. Results in $OUT.
#   LIMIT=540 bash docs/concurrency_run.sh   (pytest and its needs as wheels: PYTHONPATH set as the device README says)
#   LAYERS=16 ...                            (a quarter of the 27B's layers, a short lease)
set -u
OUT=${OUT:-/tmp/concurrency-run}
LIMIT=${LIMIT:-540}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.csv" 2>&1
left() { echo $((LIMIT - SECONDS)); }
t0=$SECONDS
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu --junitxml="$OUT/gpu-junit.xml" \
  tests/engine/test_engine_batch_graphs_gpu.py \
  "tests/engine/test_engine_int4_gpu.py::test_the_batched_int4_gemv_matches_dequantise_then_matmul_and_the_one_row_gemv_on_the_gpu" \
  > "$OUT/gpu.log" 2>&1
echo "gpu tests: exit $? in $((SECONDS - t0)) s"; tail -3 "$OUT/gpu.log"
b() {  # b NAME MODULE ARGS...: inside what is left of LIMIT, 20 s kept for the next
  local name=$1; shift
  local t=$(( $(left) - 20 )) t0=$SECONDS
  [ "$t" -gt 30 ] || { echo "$name: skipped, $(left) s left"; return; }
  timeout "$t" python3 -m "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2> "$OUT/$name.err"
  echo "$name: exit $? in $((SECONDS - t0)) s"
}
b int4-rows engine.bench.int4_rows --sweep-rows 2,8,16
b conc-bf16-4k engine.bench.concurrency --context 4096 --batches 1,2,4,8,16 --profile 8 --agree 32 ${LAYERS:+--layers $LAYERS}
b conc-bf16-4k-rowstorch engine.bench.concurrency --context 4096 --batches 1,8 --skip-solo --skip-eager \
  --rows-torch ${LAYERS:+--layers $LAYERS}
b conc-int4-4k engine.bench.concurrency --context 4096 --batches 1,2,4,8,16 --int4 --profile 8 \
  ${LAYERS:+--layers $LAYERS}
b conc-int4-4k-onerow4 engine.bench.concurrency --context 4096 --batches 1,2,3,4 --int4 --skip-solo --skip-eager \
  --int4-one-row-upto 4 ${LAYERS:+--layers $LAYERS}
# the same through HTTP, two ranks on the one card (device mailbox: eager steps there), then with --batch-graphs
# where the pair runs graphs (two cards: --devices cuda:0,cuda:1)
b served-conc engine.bench.served_concurrency --layers ${SERVED_LAYERS:-16} --devices ${DEVICES:-cuda:0,cuda:0} \
  --batches 1,2,4,8 --prompt-tokens 256 --short 16 --long 80 --max-context 4096 --workdir /tmp/served-conc
