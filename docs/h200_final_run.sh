#!/usr/bin/env bash
# The two device calls on a lent H200 of 2026-12-01 (the merged engine); results in $OUT.
#   bash docs/h200_final_run.sh a   GPU tests of the hybrid and fused kernels; the 27B hybrid bench (decode only)
#                                   with the bf16 and the int8 K/V cache; the attention kernel's configurations.
#   bash docs/h200_final_run.sh b   the 27B hybrid decode with the attention tile table and the int8 scales
#                                   factored out; the int4 GEMV / step bench and its GPU tests; the quick probe's
#                                   time; time to first token of a long conversation through the service (cold,
#                                   follow-up, repeat); the MTP greedy check.
set -u
case "${1:-}" in a|b) PART=$1 ;; *) echo "usage: bash docs/h200_final_run.sh a|b" >&2; exit 2 ;; esac
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

# bench_27b TIMEOUT_S CONTEXTS TAIL_LINES: the 27B hybrid's decode with each K/V cache type, then a summary
bench_27b() {
  for kv in auto int8; do
    timeout "$1" python3 -m engine bench --config engine/data/qwen3.5-27b.config.json --contexts "$2" \
      --prefill-tokens "" --skip-allreduce --kv-cache-dtype $kv --out "$OUT/bench-27b-$kv.json" > /dev/null 2> "$OUT/bench-27b-$kv.err"
    echo "bench $kv exit $?"; tail -"$3" "$OUT/bench-27b-$kv.err"
  done
  python3 - "$OUT" <<'PY'
import json, sys, os
for kv in ("auto", "int8"):
    f = os.path.join(sys.argv[1], f"bench-27b-{kv}.json")
    if not os.path.exists(f):
        continue
    d = json.load(open(f))
    print(kv, "read", d.get("read_bw_gbps"), "fit", (d.get("fit") or {}).get("service_graph"))
    for ctx, r in (d.get("decode", {}).get("service_graph") or {}).items():
        print(" ", kv, ctx, r.get("ms"), "ms", r.get("of_floor"), "of floor")
PY
}

if [ "$PART" = a ]; then
  timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS:-tests/engine/test_engine_hybrid_gpu.py tests/engine/test_engine_fused_gpu.py} \
    --junitxml "$OUT/gpu-tests.xml" 2>&1 | tail -25 | tee "$OUT/gpu-tests.txt"
  bench_27b 200 1024,32768,131072,262144 3
  timeout "${ATT_S:-170}" python3 -m engine.bench.attention --out "$OUT/attention.json" > "$OUT/attention.stdout" 2>&1
  echo "attention exit $?"; tail -c 3000 "$OUT/attention.stdout"
  exit 0
fi
bench_27b 100 1024,131072,262144 2
timeout 80 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_engine_int4_gpu.py tests/engine/test_engine_hybrid_gpu.py \
  --junitxml "$OUT/gpu-tests.xml" 2>&1 | tail -6 | tee "$OUT/gpu-tests.txt"
timeout 150 python3 -m engine.bench.int4 --out "$OUT/int4.json" > "$OUT/int4.stdout" 2>&1; echo "int4 exit $?"
tail -c 1500 "$OUT/int4.stdout"
timeout 60 python3 -m probes.time_quick > "$OUT/quick-probe.json" 2>&1; echo "quick probe exit $?"
python3 -c "import json;d=json.load(open('$OUT/quick-probe.json'));print({k:(v.get('wall_s') if isinstance(v,dict) else v) for k,v in d.items()})" 2>&1 | tail -2
timeout 170 python3 -m engine.bench.prefix_ttft --layers 16 --conversation 100000 --out "$OUT/prefix-ttft.json" > /dev/null 2>&1
echo "prefix exit $?"; python3 -c "import json;d=json.load(open('$OUT/prefix-ttft.json'));print({k:v for k,v in d.items() if 'ttft' in k or k in ('error','checkpoint')})"
python3 -m engine make-demo-model /tmp/mtp --arch qwen3_5 --mtp > /dev/null
for s in off mtp; do timeout 60 python3 -m engine generate --model /tmp/mtp --device cuda --dtype float32 \
  --prompt-ids 1,40,41,42,43 --max-tokens 48 --speculative $s --draft-tokens 3 --json 2>/dev/null | tail -1 | tee -a "$OUT/mtp.txt"; done
