#!/usr/bin/env bash
# The device calls on a lent H200 of 2026-12-04: the engine with the apart attention and int8's long-window blocks
# as its defaults (engine.kernels.decode.launch_config). Results in $OUT, also packed into $OUT/run-<part>.tgz (the
# device returns only a few files per call).
#   bash docs/h200_defaults_run.sh a   the 27B hybrid decode step (bf16 and int8 K/V) at 1K / 128K / 256K; the
#                                      one-query attention's default launch against one forced configuration at
#                                      128K / 256K (bf16, and float16 for the permuted int8 widening); the int4
#                                      27B step at 1K / 128K.
#   bash docs/h200_defaults_run.sh b   the GPU tests of the kernels the defaults change (fused, hybrid, int4, the
#                                      captured graphs of decoding and of speculation), as JUnit XML; the int4
#                                      step again (its JSON).
#   bash docs/h200_defaults_run.sh c   where the time goes: the 27B step at 1K in int4 and in bf16 under
#                                      torch.profiler (--profile), and Nsight Compute's counters of the int4
#                                      GEMV on two matrices (docs/int4_ncu.py).
#   bash docs/h200_defaults_run.sh d   the int4 GEMV launched during its row kernel (PDL) against the serial
#                                      launches in the same run: the table's configurations on every 27B matrix and
#                                      the step at 1K / 128K with its profile, each way; then the GPU tests.
set -u
case "${1:-}" in a|b|c|d) PART=$1 ;; *) echo "usage: bash docs/h200_defaults_run.sh a|b|c|d" >&2; exit 2 ;; esac
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
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
if [ "$PART" = d ]; then
  CFG="64,128,4,4,2,1;32,128,2,8,2,1;128,128,8,4,2,1;64,128,4,32,2,1;64,128,4,8,1,1;64,128,4,16,2,1;64,128,4,8,2,1"
  for pdl in 1 0; do
    V100PLAN_ENGINE_INT4_PDL=$pdl timeout 150 python3 -m engine.bench.int4 --skip prefill,fp16 --layouts 32 \
      --configs "$CFG" --profile --out "$OUT/int4-pdl$pdl.json" > "$OUT/int4-pdl$pdl.stdout" 2>&1
    echo "int4 pdl=$pdl exit $?"
  done
  python3 - "$OUT" <<'PY'
import json, os, sys
for pdl in (1, 0):
    p = os.path.join(sys.argv[1], f"int4-pdl{pdl}.json")
    if not os.path.exists(p):
        continue
    d = json.load(open(p))
    print("pdl", pdl, "bytes-weighted", d["int4_summary"]["bytes_weighted_fraction"],
          {f"{s}:{m}": r["best"]["us"] for s, v in d["int4"].items() for m, r in v.items()})
    for c, r in d["step"]["contexts"].items():
        pr = r["profile"]
        print("  step", c, r["ms"], r["of_floor"], "busy", pr["busy_us"], "idle", pr["idle_us"],
              [(t["kernel"][:16], t["us"]) for t in pr["top"][:3]])
PY
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_engine_int4_gpu.py \
    tests/engine/test_engine_fused_gpu.py tests/engine/test_engine_hybrid_gpu.py tests/engine/test_engine_spec_graphs_gpu.py \
    tests/engine/test_engine_graphs_gpu.py --junitxml "$OUT/gpu-tests.xml" 2>&1 | tail -8 | tee "$OUT/gpu-tests.txt"
  exit 0
fi
if [ "$PART" = c ]; then
  timeout 100 python3 -m engine.bench.int4 --skip int4,prefill,fp16 --contexts 1024 --profile \
    --out "$OUT/int4-step-profile.json" > "$OUT/int4-step-profile.stdout" 2>&1
  echo "int4 profile exit $?"
  timeout 100 python3 -m engine bench --config engine/data/qwen3.5-27b.config.json --contexts 1024 \
    --prefill-tokens "" --skip-allreduce --profile --out "$OUT/bench-27b-profile.json" > /dev/null 2> "$OUT/bench-27b-profile.err"
  echo "bf16 profile exit $?"
  python3 - "$OUT" <<'PY'
import json, os, sys
for f, get in (("int4-step-profile.json", lambda d: d["step"]["contexts"]["1024"]),
               ("bench-27b-profile.json", lambda d: d["decode"]["service_graph"]["1024"])):
    p = os.path.join(sys.argv[1], f)
    if os.path.exists(p):
        r = get(json.load(open(p)))
        pr = r["profile"]
        print(f, r["ms"], "ms; kernels", pr["kernels_per_replay"], "busy", pr["busy_us"], "idle", pr["idle_us"])
        for t in pr["top"][:14]:
            print("  ", t["launches"], t["us"], t["kernel"][:70])
PY
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  echo "ncu: $NCU"
  timeout 200 "$NCU" --clock-control none -k regex:int4 --launch-count 12 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SchedulerStats --csv --page details python3 docs/int4_ncu.py \
    > "$OUT/int4-ncu.csv" 2> "$OUT/int4-ncu.err"
  echo "ncu exit $?"; tail -3 "$OUT/int4-ncu.err"
  python3 - "$OUT/int4-ncu.csv" <<'PY'
import csv, sys
want = ("DRAM Throughput", "Memory Throughput", "Duration", "Achieved Occupancy", "Registers Per Thread",
        "Grid Size", "Block Size", "Issued Warp Per Scheduler", "No Eligible", "Eligible Warps Per Scheduler",
        "Theoretical Occupancy", "L2 Hit Rate", "Mem Busy", "Max Bandwidth", "Warp Cycles Per Issued Instruction")
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 14]
if not rows:
    sys.exit("no ncu rows")
h = rows[0]
ik, im, iu, iv = h.index("Kernel Name"), h.index("Metric Name"), h.index("Metric Unit"), h.index("Metric Value")
ii = h.index("ID")
for r in rows[1:]:
    if r[ii] in ("4", "5", "10", "11") and any(r[im].startswith(w) for w in want):
        print(r[ii], r[ik][:18], r[im], r[iv], r[iu])
PY
  exit 0
fi
timeout 100 python3 -m engine.bench.int4 --skip int4,prefill,fp16 --out "$OUT/int4-step.json" > "$OUT/int4-step.stdout" 2>&1
echo "int4 step exit $?"
timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_engine_fused_gpu.py \
  tests/engine/test_engine_hybrid_gpu.py tests/engine/test_engine_int4_gpu.py tests/engine/test_engine_spec_graphs_gpu.py \
  tests/engine/test_engine_graphs_gpu.py --junitxml "$OUT/gpu-tests.xml" 2>&1 | tail -25 | tee "$OUT/gpu-tests.txt"
