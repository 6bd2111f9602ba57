#!/usr/bin/env bash
# One device call on a lent H200 for the hybrid (Qwen3.5) engine: versions, the GPU tests of the hybrid and
# fused kernels, then `python -m engine bench` on the 27B shape (random bf16 weights made on the GPU): the
# decode step at 1K / 32K / 128K / 256K against its floor, and prefill of 8K and 128K prompts.
# Everything lands in $OUT (bench-27b.json, gpu-tests.txt, versions.txt).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_engine_hybrid_gpu.py \
  tests/engine/test_engine_fused_gpu.py -s 2>&1 | tail -40 | tee "$OUT/gpu-tests.txt"
timeout "${BENCH_S:-330}" python3 -m engine bench --config engine/data/qwen3.5-27b.config.json \
  --contexts "${CONTEXTS:-1024,32768,131072,262144}" --prefill-tokens "${PREFILL:-8192,131072}" \
  --skip-allreduce --peak-tflops 989.5 --peak-source "H200 SXM datasheet, dense bf16" \
  --out "$OUT/bench-27b.json" > "$OUT/bench-27b.stdout" 2> "$OUT/bench-27b.stderr"
echo "bench exit $?"
tail -5 "$OUT/bench-27b.stderr"
python3 - "$OUT/bench-27b.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("read", d.get("read_bw_gbps"), "GB/s; weights", d.get("weight_bytes"), "; gemv", d.get("gemv"))
for ctx, r in (d.get("decode", {}).get("service_graph") or {}).items():
    print(ctx, r.get("ms"), "ms", r.get("of_floor"), "of floor", r.get("kernels"))
for n, r in (d.get("prefill") or {}).items():
    print("prefill", n, r)
PY
