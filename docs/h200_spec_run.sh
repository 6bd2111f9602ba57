#!/bin/bash
# One H200 (nvidia-h200): MTP speculation's captured rounds. The GPU tests (graphs vs eager bodies, tokens vs
# one-token decoding), the bench (python -m engine.bench.mtp: step, verification K = 1..4, drafts, rollback, tok/s at
# 0.745 / 0.49, projected to 64 layers), and generate with and without speculation on the MTP demo.
# Run from the repository root: bash docs/h200_spec_run.sh (about 5 minutes; results under $OUT).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_engine_spec_graphs_gpu.py 2>&1 | tail -25 | tee "$OUT/spec-gpu-tests.txt"
timeout 200 python3 -m engine.bench.mtp --layers 8,16 --context 4096 --out "$OUT/mtp-bench.json" > /dev/null 2> "$OUT/mtp-bench.err"
echo "bench exit $?"; tail -3 "$OUT/mtp-bench.err"
python3 -c "import json;d=json.load(open('$OUT/mtp-bench.json'));f=d['full_depth'];print('step',f['step_ms']);[print(k,r['verify_ms'],r['verify_over_step'],{a:r['at_rates'][a] for a in ('0.745','0.49')}) for k,r in f['K'].items()]" 2>&1 | tail -6
python3 -m engine make-demo-model /tmp/mtp --arch qwen3_5 --mtp > /dev/null
for dt in float32 bfloat16; do for s in off mtp; do  # float32: equal tokens; bf16: equal away from near-ties
  echo -n "$dt $s: " | tee -a "$OUT/mtp.txt"
  timeout 90 python3 -m engine generate --model /tmp/mtp --device cuda --dtype $dt --prompt-ids 1,40,41,42,43 \
    --max-tokens 48 --speculative $s --draft-tokens 3 --json 2>/dev/null | tail -1 | tee -a "$OUT/mtp.txt"; done; done
