#!/usr/bin/env bash
# The device calls on a lent H200 of 2026-12-04: the engine with the apart attention and int8's long-window blocks
# as its defaults (engine.core.attention.launch_config). Results in $OUT, also packed into $OUT/run-<part>.tgz (the
# device returns only a few files per call).
#   bash docs/h200_defaults_run.sh a   the 27B hybrid decode step (bf16 and int8 K/V) at 1K / 128K / 256K; the
#                                      one-query attention's default launch against one forced configuration at
#                                      128K / 256K (bf16, and float16 for the permuted int8 widening); the int4
#                                      27B step at 1K / 128K.
#   bash docs/h200_defaults_run.sh b   the GPU tests of the kernels the defaults change (fused, hybrid, int4, the
#                                      captured graphs of decoding and of speculation), as JUnit XML; the int4
#                                      step again (its JSON).
set -u
case "${1:-}" in a|b) PART=$1 ;; *) echo "usage: bash docs/h200_defaults_run.sh a|b" >&2; exit 2 ;; esac
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TOP=${OUT:-/tmp/out}
OUT=$TOP/raw  # everything goes here; only the packed copy lies at the top
mkdir -p "$OUT"
pack() { tar czf "$TOP/run-$PART.tgz" -C "$OUT" .; }
trap pack EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.csv" 2>&1

if [ "$PART" = a ]; then
  for kv in auto int8; do
    timeout 110 python3 -m engine bench --config engine/data/qwen3.5-27b.config.json --contexts 1024,131072,262144 \
      --prefill-tokens "" --skip-allreduce --kv-cache-dtype $kv --out "$OUT/bench-27b-$kv.json" > /dev/null 2> "$OUT/bench-27b-$kv.err"
    echo "bench $kv exit $?"; tail -2 "$OUT/bench-27b-$kv.err"
  done
  # The default row (what decode_attention launches) next to one forced configuration, the sweep's winner.
  timeout 80 python3 -m engine.bench.attention --contexts 131072,262144 --blocks 32,64 --warps 4 --programs 264 \
    --stages 3 --apart 1 --out "$OUT/attention-bf16.json" > "$OUT/attention-bf16.stdout" 2>&1
  echo "attention bf16 exit $?"
  timeout 60 python3 -m engine.bench.attention --contexts 131072 --kv int8 --dtype float16 --blocks 32 --warps 4 \
    --programs 264 --stages 3 --apart 1 --out "$OUT/attention-fp16.json" > "$OUT/attention-fp16.stdout" 2>&1
  echo "attention fp16 exit $?"
  timeout 120 python3 -m engine.bench.int4 --skip int4,prefill,fp16 --out "$OUT/int4-step.json" > "$OUT/int4-step.stdout" 2>&1
  echo "int4 step exit $?"; tail -c 800 "$OUT/int4-step.stdout"
  python3 - "$OUT" <<'PY'
import json, os, sys
for kv in ("auto", "int8"):
    f = os.path.join(sys.argv[1], f"bench-27b-{kv}.json")
    if os.path.exists(f):
        d = json.load(open(f))
        for ctx, r in (d.get("decode", {}).get("service_graph") or {}).items():
            print(kv, ctx, r.get("ms"), "ms", r.get("of_floor"), "of floor")
for n in ("attention-bf16", "attention-fp16"):
    f = os.path.join(sys.argv[1], n + ".json")
    if os.path.exists(f):
        for r in json.load(open(f))["rows"]:
            print(n, r.get("shape"), r.get("kv"), r.get("context"), r.get("config"), r.get("us"), r.get("kv_gbps"))
PY
  exit 0
fi
timeout 100 python3 -m engine.bench.int4 --skip int4,prefill,fp16 --out "$OUT/int4-step.json" > "$OUT/int4-step.stdout" 2>&1
echo "int4 step exit $?"
timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_engine_fused_gpu.py \
  tests/engine/test_engine_hybrid_gpu.py tests/engine/test_engine_int4_gpu.py tests/engine/test_engine_spec_graphs_gpu.py \
  tests/engine/test_engine_graphs_gpu.py --junitxml "$OUT/gpu-tests.xml" 2>&1 | tail -25 | tee "$OUT/gpu-tests.txt"
