"""`v100plan accept --endpoint` against the bundled engine (real service, real ranks, real HTTP):
it passes on a healthy service, waives what needs a supervisor, fails a service whose answers
are not the reference's, and no secret reaches its outputs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.accept_support import assert_no_secret, report, run_cli, scenario
from tests.test_service_support import demo_model, service_fixture, short_dir

pytestmark = pytest.mark.slow

KEY = "sk-accept-planted-41e2b7c9d3"


svc = service_fixture("--enable-fault-injection", "--max-restarts", "3", api_key=KEY, stall_timeout_s=10.0,
                      allreduce_timeout_s=3.0)


@pytest.fixture(scope="module")
def key_file():
    path = os.path.join(short_dir("key"), "api-key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(KEY + "\n")
    return path


def test_accept_passes_a_healthy_engine_and_keeps_secrets_out(svc, key_file, tmp_path):
    out = tmp_path / "report"
    r = run_cli("accept", "--endpoint", svc.url, "--api-key-file", key_file, "--model-dir", demo_model(),
                "--state-dir", svc.state_dir, "--repeats", "1", "--requests", "24", "--clients", "6",
                "--skip", "kill_rank0,freeze_rank1,stall_allreduce", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = report(out)
    assert doc["verdict"] == "passed" and doc["target"]["server"] == "v100plan engine"
    assert doc["target"]["fault_control"] is True
    # the report says what code served: each rank's decode mode from the keyed /health (CPU: eager steps)
    dec = doc["target"]["decode"]
    assert set(dec) == {"0", "1"} and all(d["mode"] == "eager" and d["kernels"] == "eager" for d in dec.values())
    assert dec["0"]["allreduce"] and dec["0"]["allreduce"] == dec["1"]["allreduce"]
    for key in ("completion", "stream", "stream_cancel", "gone_in_prefill", "auth", "tp2_equals_tp1",
                "rank_logs_agree", "kill_rank1", "corrupt_hash", "load"):
        assert scenario(doc, key)["status"] == "passed", scenario(doc, key)
    # a dense model reuses a conversation's first turn too; it has no MTP layer, so speculation is off
    prefix = scenario(doc, "prefix_reuse")
    assert prefix["status"] == "passed" and prefix["metrics"]["follow_up_cached_tokens"] > 0, prefix
    for key in ("spec_equals_plain", "spec_fault"):
        sc = scenario(doc, key)
        assert sc["status"] == "waived" and "--speculative mtp" in sc["reason"] and "no MTP layer" in sc["reason"], sc
    assert {d["prefix_cache"] for d in dec.values()} == {"on"}
    for key in ("kill_proxy", "restart_storm"):  # no supervisor around this proxy
        sc = scenario(doc, key)
        assert sc["status"] == "waived" and "supervisor" in sc["reason"]
    assert scenario(doc, "kill_rank0")["status"] == "waived" and "--skip" in scenario(doc, "kill_rank0")["reason"]
    # The fault request is sized from the measured pace (at least 200 tokens, at most half the context),
    # and the client left gone_in_prefill's request inside the time the same prompt takes with one token.
    sized = [n for n in doc["target"]["notes"] if n.startswith("the fault scenarios' in-flight request: ")]
    assert len(sized) == 1, doc["target"]["notes"]
    tokens = int(sized[0].split(": ")[1].split()[0])
    assert tokens >= 200
    if (doc["target"]["engine"] or {}).get("max_context"):
        assert tokens <= doc["target"]["engine"]["max_context"] // 2
    gone = scenario(doc, "gone_in_prefill")["metrics"]
    assert 0 < gone["client_left_after_s"] <= min(0.15, gone["prefill_with_one_token_s"])
    rep = scenario(doc, "corrupt_hash")["repetitions"][0]
    assert rep["time_to_detect_s"] is not None and rep["time_to_recover_s"] > rep["time_to_detect_s"]
    load = doc["load"]
    assert load["requests"] == 24 and sum(load["mix"].values()) == 24
    assert load["outcomes"].get("wrong", 0) == 0 and load["outcomes"].get("lost", 0) == 0
    assert load["outcomes"].get("correct", 0) + load["outcomes"].get("cancelled", 0) == 24
    assert_no_secret(out, KEY)


def test_accept_fails_answers_that_are_not_the_reference(svc, key_file, tmp_path):
    # References from another demo model (another seed): the served answers cannot match them.
    other = os.path.join(short_dir("other"), "demo")
    subprocess.run([sys.executable, "-m", "engine", "make-demo-model", other, "--seed", "9"], check=True,
                   capture_output=True, timeout=120)
    out = tmp_path / "report"
    r = run_cli("accept", "--endpoint", svc.url, "--api-key-file", key_file, "--model-dir", other,
                "--only", "completion,tp2_equals_tp1", "--out", out)
    assert r.returncode == 1, r.stderr[-2000:]
    doc = report(out)
    assert doc["verdict"] == "failed"
    assert scenario(doc, "completion")["status"] == "failed" and "differs" in scenario(doc, "completion")["reason"]
    assert scenario(doc, "tp2_equals_tp1")["status"] == "failed"
    assert scenario(doc, "load")["status"] == "waived"
