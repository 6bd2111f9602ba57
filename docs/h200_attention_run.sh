#!/usr/bin/env bash
# One device call on a lent H200: the hybrid GPU tests, the one-query attention kernel's configurations at
# 128K / 256K (bf16 and int8 caches; engine.bench.attention), where a prefill chunk's time goes
# (engine.bench.prefill_profile), then the 27B bench with the int8 cache. Results in $OUT.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_engine_hybrid_gpu.py -s 2>&1 | tail -15 \
  | tee "$OUT/gpu-tests.txt"
timeout "${ATT_S:-200}" python3 -m engine.bench.attention --out "$OUT/attention.json" > "$OUT/attention.stdout" 2>&1
echo "attention exit $?"; tail -c 2500 "$OUT/attention.stdout"
timeout 90 python3 -m engine.bench.prefill_profile > "$OUT/prefill-profile.txt" 2>&1; echo "profile exit $?"
head -40 "$OUT/prefill-profile.txt"
