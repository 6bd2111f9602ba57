"""`v100plan qualify` with its defaults on one H200 (nvidia-h200, 2026-12-02, tests/fixtures/acceptance/
record-h200x2-qualify.sh with TESTS=tests/service/test_service_gpu.py TESTS_S=60 QUALIFY_S=420): the hybrid MTP
demo served as TP2 with its two ranks on the one card (cuda:0,cuda:0), float32, speculation on, the watchdog at
serve's defaults (qualify passes none); the code of commit e9f5cdb (ranks warm up before ready, the fork server
imports what GPU ranks need; the report's git_revision is the device copy's stale HEAD). The report
(qualify-h200-defaults-warm-2026-12-02.json, console in the .txt) is judged by what it measured: the scenarios'
own statuses and repetitions, the limits the service's keyed /health reported, the event times. kill_proxy after
the proxy's restart was cut: tests/fixtures/acceptance/kill-proxy-h200-2026-12-02/."""

from __future__ import annotations

import json
import statistics

import pytest

from engine.service import serve_config
from tests.paths import FIXTURES
from v100plan.accept.runner import verdict

NAME = "qualify-h200-defaults-warm-2026-12-02"
RANK_FAULTS = ("kill_rank1", "kill_rank0", "freeze_rank1", "corrupt_hash", "stall_allreduce", "spec_fault")


@pytest.fixture(scope="module")
def rec() -> dict:
    return json.loads((FIXTURES / "acceptance" / f"{NAME}.json").read_text())


def test_one_h200_served_the_hybrid_mtp_demo_at_the_deployed_limits(rec):
    assert [(c["name"], c["compute_capability"]) for c in rec["probe"]["cards"]] == [("NVIDIA H200", "9.0")]
    eng = rec["target"]["engine"]
    assert eng["devices"] == ["cuda:0", "cuda:0"] and eng["tp"] == 2
    assert eng["speculative"] == {"method": "mtp", "draft_tokens": 3}
    # the limits in force are the ones serve (and so deploy) runs with when given no flag
    assert rec["target"]["limits"] == {
        "liveness_timeout_s": serve_config.DEFAULT_LIVENESS_TIMEOUT_S,
        "heartbeat_interval_s": serve_config.HEARTBEAT_INTERVAL_S,
        "stall_timeout_s": serve_config.DEFAULT_STALL_TIMEOUT_S,
        "allreduce_timeout_s": serve_config.DEFAULT_ALLREDUCE_TIMEOUT_S,
        "max_restarts": serve_config.DEFAULT_MAX_RESTARTS,
        "start_timeout_s": serve_config.DEFAULT_START_TIMEOUT_S}
    assert not rec["partial"] and rec["provenance"]["inputs"]["repeats"] == 3


def test_every_scenario_that_ran_passed_and_the_only_waiver_is_a_missing_package(rec):
    counts = {s: sum(1 for sc in rec["scenarios"] if sc["status"] == s)
              for s in ("passed", "warned", "failed", "waived", "error")}
    assert counts == {"passed": 24, "warned": 0, "failed": 0, "waived": 1, "error": 0}
    assert rec["summary"] == counts and rec["verdict"] == "passed" == verdict(rec["scenarios"], None)[0]
    by = {s["key"]: s for s in rec["scenarios"]}
    assert by["openai_client"]["status"] == "waived" and "not installed" in by["openai_client"]["reason"]
    for key in ("prefix_reuse", "spec_equals_plain", "spec_fault", "restart_storm", "kill_proxy", "load"):
        assert by[key]["status"] == "passed", key
    load = rec["load"]
    assert load["outcomes"].get("duplicate", 0) == 0 and load["outcomes"]["correct"] > 0


def _medians(s: dict) -> tuple[float, float, float]:
    reps = [r for r in s["repetitions"] if r["status"] == "passed"]
    assert len(reps) == 3, s["key"]
    healthy = [min(e["t_s"] for e in r["events"] if e["label"].startswith("/health 200")) for r in reps]
    detect = statistics.median(r["time_to_detect_s"] for r in reps)
    recover = statistics.median(r["time_to_recover_s"] for r in reps)
    # the report's own medians are those of its repetitions
    assert s["time_to_detect_s"]["median"] == pytest.approx(detect) and s["time_to_recover_s"]["median"] == \
        pytest.approx(recover)
    return detect, statistics.median(healthy), recover


def test_rank_faults_are_detected_within_the_liveness_limit_and_answered_exactly_within_5_s(rec):
    by = {s["key"]: s for s in rec["scenarios"]}
    liveness = rec["target"]["limits"]["liveness_timeout_s"]
    for key in RANK_FAULTS:
        detect, healthy, recover = _medians(by[key])
        # a kill or a wrong hash is seen at once; a freeze or a stalled allreduce at the liveness timeout
        assert detect <= liveness + 0.5, (key, detect)
        assert healthy < recover <= 5.0, (key, healthy, recover)  # the first exact answer, from the injection
        # the new ranks' first answer costs what any answer does (it paid 5-7 s before the warm-up)
        assert recover - healthy < 1.0, (key, healthy, recover)

