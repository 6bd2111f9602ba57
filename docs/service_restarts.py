"""Recovery of `python -m engine serve` after a killed rank: from the kill to /health 200 and to the
first correct answer, for a kill with time to spare after the previous restart and for one right
after a restart (the case a pool of pre-imported processes, still importing, used to slow down).

    .venv/bin/python docs/service_restarts.py --rounds 4                  # demo model, two CPU ranks
    python3 docs/service_restarts.py --rounds 3 --device cuda             # a host with two GPUs
    .venv/bin/python docs/service_restarts.py --rounds 4 -- --no-standby-ranks   # extra serve flags

Each kill also times the first answer after /health 200 and the same request again (a first request that pays
for something the new ranks do once shows as first_answer_s >> second_answer_s).

Prints one JSON line per kill, then one with the medians, the worst and the load average; run from
the repository root (it starts the service as the tests do, tests/test_service_support.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())

from tests.test_service_support import MODEL_ID, ServiceProcess, expected_tokens, prompt_ids, wait_until  # noqa: E402

# main() puts the served model's name in "model"
LONG = {"model": MODEL_ID, "prompt": "Long story", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
PROMPT = "The quick brown fox"


def kill_mid_request(svc: ServiceProcess, rank: int, reference: list[int]) -> dict:
    before = svc.wait_healthy()
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=svc.client.post("/v1/completions", json=LONG, timeout=300)))
    t.start()
    wait_until(lambda: svc.metric("v100plan_requests_running") == 1, 30, 0.02, what="the request to run")
    t0 = time.monotonic()
    svc.inject("kill", rank=rank)
    t.join()
    svc.wait_healthy(timeout_s=300, newer_than=before["generation"])
    healthy = time.monotonic() - t0
    answer = svc.complete(PROMPT, 16, model=LONG["model"]).json()["v100plan"]["token_ids"]
    answered = time.monotonic() - t0
    t1 = time.monotonic()  # the same request again: what the new ranks' first request paid once
    again = svc.complete(PROMPT, 16, model=LONG["model"]).json()["v100plan"]["token_ids"]
    return {"client_status": out["r"].status_code, "healthy_s": round(healthy, 2),
            "answered_s": round(answered, 2), "first_answer_s": round(answered - healthy, 2),
            "second_answer_s": round(time.monotonic() - t1, 2), "correct": answer == reference == again}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--settle-s", type=float, default=12.0, help="pause before each kill with time to spare")
    p.add_argument("--model", default=None, help="model directory (default: the tests' dense demo)")
    p.add_argument("--log-out", default=None, help="write the service's log (ranks' lines too) to this file")
    p.add_argument("serve_flags", nargs="*", help="more `engine serve` flags (after --)")
    a = p.parse_args()
    svc = ServiceProcess("--enable-fault-injection", "--liveness-timeout-s", "4", "--max-restarts", "20",
                         "--device", a.device, *a.serve_flags, model=a.model, stall_timeout_s=120,
                         allreduce_timeout_s=60)
    try:
        svc.wait_healthy(timeout_s=600)
        LONG["model"] = svc.client.get("/v1/models").json()["data"][0]["id"]
        reference = svc.complete(PROMPT, 16, model=LONG["model"]).json()["v100plan"]["token_ids"]
        if a.device == "cpu" and a.model is None:
            assert reference == expected_tokens(prompt_ids(PROMPT), 16)
        spare, right_after = [], []
        for i in range(a.rounds):
            time.sleep(a.settle_s)
            spare.append(kill_mid_request(svc, i % 2, reference))
            right_after.append(kill_mid_request(svc, 1 - i % 2, reference))
            print(json.dumps({"round": i, "with_time_to_spare": spare[-1], "right_after_a_restart": right_after[-1]}),
                  flush=True)
        restarts = [{k: e.get(k) for k in ("generation", "start_s", "forked")} for e in svc.events("restart")]
        summary = {name: {"answered_median_s": round(statistics.median(r["answered_s"] for r in runs), 2),
                          "answered_worst_s": max(r["answered_s"] for r in runs),
                          "all_correct": all(r["correct"] for r in runs)}
                   for name, runs in (("with_time_to_spare", spare), ("right_after_a_restart", right_after))}
        print(json.dumps({**summary, "restarts": restarts, "load_average": os.getloadavg(), "device": a.device}))
    finally:
        if a.log_out:
            with open(a.log_out, "w") as fh:
                fh.write(svc.log_text())
                for path in sorted(Path(svc.state_dir).rglob("rank*.log")):  # each rank's own lines
                    fh.write(f"==> {path.name}\n" + path.read_text(errors="replace"))
        svc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
