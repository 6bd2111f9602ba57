#!/usr/bin/env bash
# The device calls on a lent H200 of 2026-12-04 (afternoon): the int4 GEMV's subnormal-pairs form, and the 27B
# shape at 256K with the bench's own memory sampler. Results in $OUT/raw, packed into $OUT/run-<part>.tgz (the
# device returns only a few files per call).
#   bash docs/h200_subn_run.sh e   the table's pairs-form configurations and the subnormal-pairs form's on every
#                                  27B matrix, words in tiles of 32 rows and in the same tiles in quads (LAYOUTS), the
#                                  fastest per matrix timed with its prologue; the 27B int4 step at 1K / 128K under
#                                  torch.profiler with the engine's table and with quads and their fastest blocks;
#                                  then the int4 GPU tests (JUnit XML).
#   bash docs/h200_subn_run.sh f   the full 64-layer 27B shape served at 262,144 positions, two ranks on the card,
#                                  through HTTP (engine.bench.long_context: TTFT, decode at the end, nvidia-smi
#                                  memory); needs fastapi & co. (pip wheels in .whl, installed to /tmp/site).
#   bash docs/h200_subn_run.sh h   a persistent grid (blocks[6]: programs a multiprocessor) for the table's
#                                  configurations on every 27B matrix, against the ordinary grid in the same run;
#                                  the int4 step at 1K / 128K with each matrix's fastest, under torch.profiler; the
#                                  int4 GPU tests.
#   bash docs/h200_subn_run.sh i   Nsight Compute's stall reasons, DRAM and L1/L2 traffic of the int4 GEMV: the
#                                  table's gate/up and down at TP1, and the subnormal form on quads
#                                  (docs/int4_ncu_stalls.py).
#   bash docs/h200_subn_run.sh j   the pairs form two tiles ahead in registers (stages 5, AHEAD2) against one tile
#                                  ahead and no prefetch, the table's blocks on every 27B matrix; the int4 step with
#                                  the fastest under torch.profiler; the int4 GPU tests.
#   bash docs/h200_subn_run.sh g   with the subnormal-pairs form as the default: the int4 step and the GPU tests of
#                                  the kernels it changes (int4, fused, hybrid, graphs).
set -u
case "${1:-}" in e|f|g|h|i|j) PART=$1 ;; *) echo "usage: bash docs/h200_subn_run.sh e|f|g|h|i|j" >&2; exit 2 ;; esac
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TOP=${OUT:-/tmp/out}
OUT=$TOP/raw
mkdir -p "$OUT"
pack() { tar czf "$TOP/run-$PART.tgz" -C "$OUT" .; }
trap pack EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.csv" 2>&1

by_field() {  # the fastest timing per value of one blocks field (configuration keys BNxBKxWxSxSTxFORM[xP]-LAYOUT)
  python3 - "$1" "$2" <<'PY'
import json, sys
d, field = json.load(open(sys.argv[1])), int(sys.argv[2])
for s, v in d["int4"].items():
    for m, r in v.items():
        by = {}
        for key, c in r["configs"].items():
            if "us" in c:
                f = int(key.split("-")[0].split("x")[field])
                by[f] = min(by.get(f, 1e9), c["us"])
        print(" ", s, m, {f: by[f] for f in sorted(by)})
PY
}

sweep_gpu() {  # sweep --configs CFG (NAME: the output), its summary, the fastest per blocks FIELD; the int4 GPU tests
  local name=$1 field=$2 cfg=$3
  timeout 300 python3 -m engine.bench.int4 --skip prefill,fp16 --layouts 32 --configs "$cfg" --profile \
    --out "$OUT/$name.json" > "$OUT/$name.stdout" 2>&1
  echo "int4 exit $?"; [ -f "$OUT/$name.json" ] && summary "$OUT/$name.json" || tail -20 "$OUT/$name.stdout"
  [ -f "$OUT/$name.json" ] && by_field "$OUT/$name.json" "$field"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_engine_int4_gpu.py \
    --junitxml "$OUT/gpu-tests.xml" 2>&1 | tail -12 | tee "$OUT/gpu-tests.txt"
}

summary() {
  python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
if "int4_summary" in d:
    print("bytes-weighted", d["int4_summary"]["bytes_weighted_fraction"], "read", d["read_bw_gbps"])
    for s, v in d["int4"].items():
        for m, r in v.items():
            by = {}
            for key, c in r["configs"].items():
                if "us" in c:
                    f = key.split("-")[0].split("x")[5]
                    if f not in by or c["us"] < by[f][1]:
                        by[f] = (key, c["us"])
            b = r.get("best", {})
            print(" ", s, m, "best", b.get("blocks"), b.get("us"), b.get("fraction"), "pro", b.get("prologue_us"),
                  "row", b.get("row_kernel_us"), "by form", by)
for c, r in d.get("step", {}).get("contexts", {}).items():
    pr = r.get("profile") or {}
    print("step", c, r["ms"], r["of_floor"], "busy", pr.get("busy_us"), "idle", pr.get("idle_us"),
          [(t["kernel"][:18], t["us"]) for t in pr.get("top", [])[:4]])
PY
}

if [ "$PART" = e ]; then
  PAIRS="64,128,4,4,2,1;32,128,2,8,2,1;128,128,8,4,2,1;64,128,4,32,2,1;64,128,4,8,1,1;64,128,4,16,2,1;64,128,4,8,2,1"
  SUBN="128,128,4,2,2,2;128,128,4,4,2,2;128,128,4,8,2,2;128,128,4,16,2,2;64,128,2,4,2,2;64,128,2,8,2,2"
  SUBN="$SUBN;64,128,2,16,2,2;64,128,2,32,2,2;256,128,8,2,2,2;256,128,8,4,2,2;32,128,1,8,2,2;32,128,1,32,2,2"
  LAYOUTS=${LAYOUTS:-32,q32}
  timeout 240 python3 -m engine.bench.int4 --skip prefill,fp16,step --layouts "$LAYOUTS" --configs "$PAIRS;$SUBN" \
    --out "$OUT/int4-subn.json" > "$OUT/int4-subn.stdout" 2>&1
  echo "int4 exit $?"; [ -f "$OUT/int4-subn.json" ] && summary "$OUT/int4-subn.json" || tail -20 "$OUT/int4-subn.stdout"
  # the step twice: the engine's table (pairs, tiles) and, words in quads, each matrix's fastest on quads
  python3 - "$OUT/int4-subn.json" "$OUT/quads-blocks.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
best = {f"{r['best']['prologue']}:{r['n']}x{r['k']}": r["best_by_layout"]["q32"]["blocks"]
        for v in d["int4"].values() for r in v.values() if "q32" in r.get("best_by_layout", {})}
json.dump({"best_blocks": best}, open(sys.argv[2], "w"))
print("quads blocks", best)
PY
  timeout 90 python3 -m engine.bench.int4 --skip int4,prefill,fp16 --profile --out "$OUT/step-table.json" \
    > "$OUT/step-table.stdout" 2>&1
  echo "step table exit $?"; [ -f "$OUT/step-table.json" ] && summary "$OUT/step-table.json"
  V100PLAN_ENGINE_INT4_QUADS=1 V100PLAN_ENGINE_INT4_BLOCKS="$OUT/quads-blocks.json" timeout 90 python3 -m engine.bench.int4 \
    --skip int4,prefill,fp16 --profile --out "$OUT/step-quads.json" > "$OUT/step-quads.stdout" 2>&1
  echo "step quads exit $?"; [ -f "$OUT/step-quads.json" ] && summary "$OUT/step-quads.json"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_engine_int4_gpu.py \
    --junitxml "$OUT/gpu-tests.xml" 2>&1 | tail -12 | tee "$OUT/gpu-tests.txt"
  exit 0
fi
if [ "$PART" = h ]; then
  CFG=""
  for c in 64,128,4,4,2,1 32,128,2,8,2,1 128,128,8,4,2,1 64,128,4,32,2,1 64,128,4,8,1,1 64,128,4,16,2,1 64,128,4,8,2,1; do
    for p in 0 4 8 12 16; do CFG="$CFG;$c,$p"; done
  done
  sweep_gpu int4-persist 6 "${CFG#;}"
  exit 0
fi
if [ "$PART" = j ]; then
  CFG=""
  for c in 64,128,4,4 32,128,2,8 128,128,8,4 64,128,4,32 64,128,4,8 64,128,4,16 128,128,8,8 32,128,2,16; do
    for st in 1 2 5; do CFG="$CFG;$c,$st,1"; done
  done
  sweep_gpu int4-ahead2 4 "${CFG#;}"
  exit 0
fi
if [ "$PART" = i ]; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  echo "ncu: $NCU"
  M=""
  for r in long_scoreboard lg_throttle wait math_pipe_throttle not_selected selected short_scoreboard barrier \
           mio_throttle no_instruction dispatch_stall drain membar tex_throttle branch_resolving imc_miss; do
    M="$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
  done
  M="${M#,},dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,gpu__time_duration.sum"
  M="$M,lts__t_sectors_srcunit_tex_op_read.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum"
  M="$M,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,sm__warps_active.avg.pct_of_peak_sustained_active"
  M="$M,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size"
  M="$M,launch__occupancy_limit_registers,smsp__inst_executed.sum,lts__t_sector_hit_rate.pct"
  timeout 400 "$NCU" --clock-control none -k regex:int4_gemv --launch-count 12 --metrics "$M" --csv \
    python3 docs/int4_ncu_stalls.py gate_up:64,128,4,4,2,1 gate_up:64,128,2,8,2,2:q down:32,128,2,8,2,1 \
    down:32,128,1,8,2,2:q > "$OUT/ncu-stalls.csv" 2> "$OUT/ncu-stalls.err"
  echo "ncu exit $?"; tail -3 "$OUT/ncu-stalls.err"
  python3 - "$OUT/ncu-stalls.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    sys.exit("no ncu rows")
h = rows[0]
ii, im, iv = h.index("ID"), h.index("Metric Name"), h.index("Metric Value")
by = {}
for r in rows[1:]:
    by.setdefault(r[ii], {})[r[im]] = r[iv]
for i, m in sorted(by.items(), key=lambda t: int(t[0])):
    if int(i) % 3 != 1:  # the second call of each configuration
        continue
    stalls = sorted(((float(v.replace(",", "")), k.split("stalled_")[1].split("_per")[0]) for k, v in m.items()
                     if "stalled" in k), reverse=True)[:6]
    print(i, {k.split("__")[1][:40]: v for k, v in m.items() if "stalled" not in k})
    print("   stalls", stalls)
PY
  exit 0
fi
if [ "$PART" = f ]; then
  mkdir -p /tmp/site && pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl > "$OUT/pip.txt" 2>&1
  export PYTHONPATH=/tmp/site:$PWD
  timeout 560 python3 -m engine.bench.long_context --max-context 262144 --tokens 32 --timeout-s 540 \
    --out "$OUT/long-27b-256k.json" > "$OUT/long.stdout" 2> "$OUT/long.stderr"
  echo "long exit $?"; tail -c 1500 "$OUT/long.stderr"
  python3 - "$OUT/long-27b-256k.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except OSError as e:
    sys.exit(f"no result: {e}")
print({k: d.get(k) for k in ("start_s", "ttft_s", "completed", "last_position", "gpu_memory_used_mib")})
print("health_end", json.dumps(d.get("health_end"))[:1500])
PY
  exit 0
fi
timeout 150 python3 -m engine.bench.int4 --skip int4,prefill,fp16 --profile --out "$OUT/int4-step.json" \
  > "$OUT/int4-step.stdout" 2>&1
echo "int4 step exit $?"; [ -f "$OUT/int4-step.json" ] && summary "$OUT/int4-step.json"
timeout 380 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_engine_int4_gpu.py \
  tests/engine/test_engine_fused_gpu.py tests/engine/test_engine_hybrid_gpu.py tests/engine/test_engine_graphs_gpu.py \
  tests/engine/test_engine_spec_graphs_gpu.py --junitxml "$OUT/gpu-tests.xml" 2>&1 | tail -12 | tee "$OUT/gpu-tests.txt"
