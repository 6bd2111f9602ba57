"""The service as it is deployed: the engine started with its default limits under its own
supervisor (`python -m engine supervise`, as qualify and deploy start it) passes every fault
scenario through `v100plan accept --endpoint` with no flag on the engine's side beyond fault
injection (and its key) and no state directory given to the suite (the failure causes come from
the keyed /control/events); every rank fault is detected and recovered within 5 s (median). The
report records the limits in force. Times print with pytest -s (docs/acceptance.md).

kill_proxy is held to KILL_PROXY_WITHIN_S, not 5 s: a proxy its supervisor restarts needs
supervisord's 1 s tick, its own start and a fresh fork server's torch import before its first pair
(3.8 s on the shared 2-core machine at load average 3.6, 6.5-8 s at load 7; docs/acceptance.md says
what would cut it)."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest

from tests.accept_support import report, run_cli, scenario
from tests.test_service_support import demo_model

pytestmark = pytest.mark.slow

RANK_FAULTS = ("kill_rank1", "kill_rank0", "freeze_rank1", "corrupt_hash", "stall_allreduce")
WITHIN_S = 5.0
KILL_PROXY_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def supervised():
    from v100plan.accept.local import LocalService

    svc = LocalService(Path(demo_model()))
    try:
        svc.start(wait_s=300)
        yield svc
    finally:
        svc.stop()
        svc.remove()


def test_every_fault_passes_at_the_default_limits_through_accept_endpoint(supervised, tmp_path):
    from engine.service import serve_config as sc

    out = tmp_path / "report"
    r = run_cli("accept", "--endpoint", supervised.endpoint, "--api-key-file", supervised.state_dir / "api-key",
                "--model-dir", demo_model(), "--supervised", "--only", "fault", "--repeats", "3", "--out", out,
                timeout_s=1500)
    doc = report(out)
    medians, lines = {}, []
    for key in (*RANK_FAULTS, "kill_proxy", "restart_storm"):
        sc_ = scenario(doc, key)
        assert sc_["status"] == "passed", (key, sc_.get("reason"))
        reps = sc_["repetitions"]
        medians[key] = (statistics.median(x["time_to_detect_s"] for x in reps),
                        statistics.median(x["time_to_recover_s"] for x in reps))
        lines.append(f"{key}: detect median {medians[key][0]:.2f} s, recover median {medians[key][1]:.2f} s "
                     f"(worst {max(x['time_to_recover_s'] for x in reps):.2f} s, n={len(reps)})")
    print(f"\nload average {os.getloadavg()[0]:.1f}\n" + "\n".join(lines))
    for key in RANK_FAULTS:
        assert max(medians[key]) <= WITHIN_S, lines
    assert max(medians["kill_proxy"]) <= KILL_PROXY_WITHIN_S, lines
    assert r.returncode == 0, r.stderr[-3000:]
    # the limits in force are serve's defaults, and the report says so
    limits = doc["target"]["limits"]
    assert limits == {"liveness_timeout_s": sc.DEFAULT_LIVENESS_TIMEOUT_S, "heartbeat_interval_s": sc.HEARTBEAT_INTERVAL_S,
                      "stall_timeout_s": sc.DEFAULT_STALL_TIMEOUT_S, "allreduce_timeout_s": sc.DEFAULT_ALLREDUCE_TIMEOUT_S,
                      "max_restarts": sc.DEFAULT_MAX_RESTARTS, "start_timeout_s": sc.DEFAULT_START_TIMEOUT_S}
    # the restart storm's end: the cap reached, serve exited 3, its supervisor started it afresh, the
    # new proxy's keyed /health names why the last one gave up
    health = supervised.health()
    assert health["previous_exit"]["code"] == 3 and health["previous_exit"]["cause"] == "selftest", health
    assert "consecutive failed rank starts" in health["previous_exit"]["reason"]
    assert not any("cause was not checked" in (s.get("reason") or "") for s in doc["scenarios"])
