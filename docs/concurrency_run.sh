#!/usr/bin/env bash
# One device call (issue 42, a lent H100 or H200): the GPU tests of the batch loop's captured step (graph replays
# equal the padded eager step bit for bit) and of the batched int4 GEMV (every blocks form, stages 1 and 2); the
# batched int4 GEMV against the one-row one (engine.bench.int4_rows, block settings swept at M = 2, 8, 16); then
# the service's batched step at C = 1..16 (engine.bench.concurrency: the graph of each row bucket, and the same
# step launched eagerly, its kernels profiled at C = 8) on the 27B hybrid shape at 4K in bf16 (and with attention
# and the Gated DeltaNet mix in their torch forms, the comparison), then int4 with the engine's routing and with
# up to 4 rows as one-row GEMVs; bf16 at 64K; last, the service through HTTP (its packages as wheels too). The
# whole script stays inside LIMIT seconds (default 540); each part gets what is left. Results in RES, packed into
# PACK (a .tgz) at the end where given (a device call brings back few files: pack them).
#   LIMIT=540 PACK=$OUT/results.tgz bash docs/concurrency_run.sh   (PYTHONPATH set to the wheels: device README)
#   PARTS="int4-rows conc-int4-4k" ...        (only these parts; default: all)
#   LAYERS=16 ...                             (a quarter of the 27B's layers, a short lease)
set -u
RES=${RES:-/tmp/concurrency-run}
LIMIT=${LIMIT:-540}
PARTS=${PARTS:-all}
mkdir -p "$RES"
[ -n "${PACK:-}" ] && trap 'tar czf "$PACK" -C "$RES" .' EXIT
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$RES/gpu.csv" 2>&1
left() { echo $((LIMIT - SECONDS)); }
want() { [ "$PARTS" = all ] || [[ " $PARTS " == *" $1 "* ]]; }
if want gpu-tests; then
  t0=$SECONDS
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu --junitxml="$RES/gpu-junit.xml" \
    tests/engine/test_engine_batch_graphs_gpu.py \
    "tests/engine/test_engine_int4_gpu.py::test_the_batched_int4_gemv_matches_dequantise_then_matmul_and_the_one_row_gemv_on_the_gpu" \
    > "$RES/gpu.log" 2>&1
  echo "gpu tests: exit $? in $((SECONDS - t0)) s"; tail -3 "$RES/gpu.log"
fi
b() {  # b NAME MODULE ARGS...: inside what is left of LIMIT, 20 s kept for the next
  local name=$1; shift
  want "$name" || return 0
  local t=$(( $(left) - 20 )) t0=$SECONDS
  [ "$t" -gt 30 ] || { echo "$name: skipped, $(left) s left"; return; }
  timeout "$t" python3 -m "$@" --out "$RES/$name.json" > "$RES/$name.log" 2> "$RES/$name.err"
  echo "$name: exit $? in $((SECONDS - t0)) s"
}
L=${LAYERS:+--layers $LAYERS}
b int4-rows engine.bench.int4_rows --sweep-rows 2,8,16
b conc-bf16-4k engine.bench.concurrency --context 4096 --batches 1,2,4,8,16 --profile 8 --agree 32 $L
b conc-bf16-4k-rowstorch engine.bench.concurrency --context 4096 --batches 1,8 --skip-solo --skip-eager --rows-torch $L
b conc-int4-4k engine.bench.concurrency --context 4096 --batches 1,2,4,8,16 --int4 --profile 8 $L
b conc-int4-4k-onerow4 engine.bench.concurrency --context 4096 --batches 1,2,3,4 --int4 --skip-solo --skip-eager \
  --int4-one-row-upto 4 $L
b conc-bf16-64k engine.bench.concurrency --context 65536 --batches 1,2,4 --skip-eager $L
# the same through HTTP, two ranks on the one card (device mailbox: eager steps there), then with --batch-graphs
# where the pair runs graphs (two cards: --devices cuda:0,cuda:1)
b served-conc engine.bench.served_concurrency --layers ${SERVED_LAYERS:-16} --devices ${DEVICES:-cuda:0,cuda:0} \
  --batches 1,2,4,8 --prompt-tokens 256 --short 16 --long 80 --max-context 4096 --workdir /tmp/served-conc
