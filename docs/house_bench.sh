#!/usr/bin/env bash
# Before and after the engine's reorganisation (issue 41), on one GPU in one device call per part: the 27B hybrid
# decode step in bf16 (python -m engine bench, as docs/h200_defaults_run.sh a ran it), the same step with every
# layer matrix packed int4 (python -m engine.bench.int4 --skip int4,prefill,fp16, as part a there), and MTP
# speculation's captured rounds (python -m engine.bench.mtp, as docs/h200_spec_run.sh). A part runs the old tree and
# the new one back to back on the same card in the order old, new, new, old (so a drift of the card shows); "all"
# runs the three benches once each per tree (old, new; at most 540 s of timeouts, so it fits one 600 s call). Prints
# new / old per figure: the issue asks each within 2 %.
#
#   bash docs/house_bench.sh PART OLD_TREE [NEW_TREE]     PART: bf16 | int4 | mtp | all
#
# OLD_TREE: a directory holding the code before the change (e.g. made on the host before the call with
#   mkdir -p shared/house-old && git archive fab3cb7 | tar -x -C shared/house-old
# so that it travels with the working tree); NEW_TREE defaults to the current directory. Results in $OUT.
set -u
PART=${1:-}
OLD=${2:-}
NEW=${3:-$PWD}
case "$PART" in bf16|int4|mtp|all) ;; *) echo "usage: bash docs/house_bench.sh bf16|int4|mtp|all OLD_TREE [NEW_TREE]" >&2; exit 2 ;; esac
if [ -z "$OLD" ] || [ ! -d "$OLD/engine" ]; then echo "OLD_TREE '$OLD' holds no engine/ directory" >&2; exit 2; fi
OLD=$(cd "$OLD" && pwd); NEW=$(cd "$NEW" && pwd)
OUT=${OUT:-/tmp/house-bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.csv" 2>&1

run() {  # run TREE_NAME TREE LABEL TIMEOUT ARGS...: one bench in that tree, its JSON in $OUT/LABEL-TREE_NAME-N.json
  local name=$1 tree=$2 label=$3 limit=$4; shift 4
  local n=1
  while [ -e "$OUT/$label-$name-$n.json" ]; do n=$((n + 1)); done
  (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" timeout "$limit" python3 "$@" --out "$OUT/$label-$name-$n.json" \
     > /dev/null 2> "$OUT/$label-$name-$n.err")
  echo "$label $name run $n: exit $?"
}

both() {  # both LABEL TIMEOUT ARGS...: old, new, then (one part a call) new, old again
  local label=$1 limit=$2; shift 2
  run old "$OLD" "$label" "$limit" "$@"
  run new "$NEW" "$label" "$limit" "$@"
  if [ "$PART" != all ]; then
    run new "$NEW" "$label" "$limit" "$@"
    run old "$OLD" "$label" "$limit" "$@"
  fi
}

if [ "$PART" = bf16 ] || [ "$PART" = all ]; then
  both bf16 70 -m engine bench --config engine/data/qwen3.5-27b.config.json --contexts 1024,131072 \
    --prefill-tokens "" --skip-allreduce
fi
if [ "$PART" = int4 ] || [ "$PART" = all ]; then
  both int4 80 -m engine.bench.int4 --skip int4,prefill,fp16 --contexts 1024,131072
fi
if [ "$PART" = mtp ] || [ "$PART" = all ]; then
  both mtp 120 -m engine.bench.mtp --layers 8 --context 4096
fi

python3 - "$OUT" <<'PY'
import glob, json, os, statistics, sys

out = sys.argv[1]


def figures(label: str, doc: dict) -> dict:
    """ms per figure: the decode step per context (bf16, int4), the MTP step and verify rounds."""
    if label == "bf16":
        return {f"step {c}": r["ms"] for c, r in doc["decode"]["service_graph"].items() if "ms" in r}
    if label == "int4":
        return {f"step {c}": r["ms"] for c, r in doc["step"]["contexts"].items() if "ms" in r}
    got = {}
    for d in doc["runs"]:  # one per --layers depth
        got[f"{d['layers']} layers step"] = d["step_ms"]
        for k, r in d["K"].items():
            got[f"{d['layers']} layers verify K={k}"] = r["verify_ms"]
            if "round_wall_ms" in r:
                got[f"{d['layers']} layers round K={k}"] = r["round_wall_ms"]
    return got


for label in ("bf16", "int4", "mtp"):
    runs = {"old": [], "new": []}
    for tree in runs:
        for f in sorted(glob.glob(os.path.join(out, f"{label}-{tree}-*.json"))):
            try:
                runs[tree].append(figures(label, json.load(open(f))))
            except (KeyError, ValueError, TypeError) as e:
                print(f"{f}: no figures ({type(e).__name__}: {e})")
    if not runs["old"] or not runs["new"]:
        continue
    print(f"== {label}: median ms of {len(runs['old'])} old / {len(runs['new'])} new runs")
    for key in runs["old"][0]:
        o = [r[key] for r in runs["old"] if key in r]
        n = [r[key] for r in runs["new"] if key in r]
        if o and n:
            mo, mn = statistics.median(o), statistics.median(n)
            flag = "ok" if mn <= 1.02 * mo else "SLOWER by more than 2 %"
            print(f"  {key:24s} old {mo:9.4f}  new {mn:9.4f}  new/old {mn / mo:.4f}  {flag}  (old {o}, new {n})")
PY
