#!/usr/bin/env bash
# Device call A on a lent H200 (2026-12-01, the merged engine): GPU tests of the hybrid, fused and int4
# kernels; the 27B hybrid bench (decode only) with the bf16 and the int8 K/V cache; the attention kernel's
# configurations. Results in $OUT.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS:-tests/engine/test_engine_hybrid_gpu.py tests/engine/test_engine_fused_gpu.py} \
  --junitxml "$OUT/gpu-tests.xml" 2>&1 | tail -25 | tee "$OUT/gpu-tests.txt"
for kv in auto int8; do
  timeout 200 python3 -m engine bench --config engine/data/qwen3.5-27b.config.json --contexts 1024,32768,131072,262144 \
    --prefill-tokens "" --skip-allreduce --kv-cache-dtype $kv --out "$OUT/bench-27b-$kv.json" > /dev/null 2> "$OUT/bench-27b-$kv.err"
  echo "bench $kv exit $?"; tail -3 "$OUT/bench-27b-$kv.err"
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
timeout "${ATT_S:-170}" python3 -m engine.bench.attention --out "$OUT/attention.json" > "$OUT/attention.stdout" 2>&1
echo "attention exit $?"; tail -c 3000 "$OUT/attention.stdout"
