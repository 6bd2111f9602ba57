"""``python -m probes.time_quick``: how long ``python -m probes --quick`` takes here, cold and warm.

Runs the quick probe twice as separate processes, the first with an empty fatbin cache (a fresh host)
and the second with the cache the first one filled, and prints one JSON document: each run's wall
time, every case's duration and status, the throttle window and verdict per card, and the goal
(20 s). It is the one command that times the quick probe on a GPU host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

GOAL_S = 20.0


def _run(env: dict[str, str]) -> dict:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "probes", "--quick", "--no-samples"], capture_output=True,
                          text=True, env=env, timeout=600)
    wall = round(time.monotonic() - t0, 2)
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        return {"wall_s": wall, "exit_code": proc.returncode, "error": proc.stderr[-2000:]}
    return {
        "wall_s": wall, "exit_code": proc.returncode, "overall": report.get("overall"),
        "cases": {c["key"]: {"status": c["status"], "duration_s": c.get("duration_s")} for c in report["cases"]},
        "throttle": {c["index"]: {k: (c.get("throttle") or {}).get(k) for k in ("verdict", "duration_s",
                                                                             "power_median_w", "sm_clock_ratio")}
                     for c in report.get("cards", [])},
        "nccl_archs_source": [lib.get("archs_source") for lib in report["host"].get("nccl_libraries") or []],
    }


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="v100plan-time-quick-") as cache:
        env = {**os.environ, "V100PLAN_CACHE_DIR": cache}
        cold = _run(env)
        warm = _run(env)
    print(json.dumps({"kind": "quick_probe_timing", "goal_s": GOAL_S, "cold_cache": cold, "warm_cache": warm,
                      "within_goal": {"cold": cold["wall_s"] <= GOAL_S, "warm": warm["wall_s"] <= GOAL_S}},
                     indent=1))
    return 0 if warm["wall_s"] <= GOAL_S and warm.get("exit_code") in (0, 3) else 1


if __name__ == "__main__":
    sys.exit(main())
