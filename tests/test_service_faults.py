"""Injected faults against a real service: each gives the in-flight request a clear error, then
the watchdog restarts both ranks (new generation, new PIDs, old ones gone) and the next answer
equals the TP1 reference. One service for the module; each test leaves it healthy."""

from __future__ import annotations

import json
import threading

import pytest

from tests.test_service_support import (
    MODEL_ID,
    ServiceProcess,
    pid_alive,
    prompt_ids,
    reference_until_eos,
    tokenizer,
    tp1_reference,
    wait_until,
)

pytestmark = pytest.mark.slow

STALL_S = 6.0
PROMPT = "The quick brown fox"
# Long enough to still be running when the fault lands, however fast the machine decodes.
LONG = {"model": MODEL_ID, "prompt": "Long story", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def svc():
    s = ServiceProcess("--enable-fault-injection", "--max-restarts", "2", stall_timeout_s=STALL_S,
                       allreduce_timeout_s=4.0)
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def _assert_recovered(svc, before: dict, cause: str | tuple[str, ...]) -> dict:
    """The service came back by itself with a new rank generation and answers exactly; the failure of
    `before`'s generation was logged with `cause` (or one of several, where the first detector wins)."""
    causes = (cause,) if isinstance(cause, str) else cause
    now = svc.wait_healthy(timeout_s=60, newer_than=before["generation"])
    for pid in before["rank_pids"]:
        wait_until(lambda p=pid: not pid_alive(p), 10, what=f"old rank pid {pid} to be gone")
    assert set(now["rank_pids"]).isdisjoint(before["rank_pids"])
    failures = [e for e in svc.events("rank_failure") if e["generation"] == before["generation"]]
    assert failures and failures[-1]["cause"] in causes, failures
    assert failures[-1]["rank_pids"] == before["rank_pids"]
    restarts = [e for e in svc.events("restart") if e["generation"] == now["generation"]]
    assert restarts and restarts[-1]["rank_pids"] == now["rank_pids"] and restarts[-1]["allreduce"]
    ids = prompt_ids(PROMPT)
    body = svc.complete(PROMPT, 16).json()
    assert body["v100plan"]["token_ids"] == reference_until_eos(tp1_reference(tuple(ids), 16)["token_ids"])
    assert body["v100plan"]["generation"] == now["generation"]
    return now


def _in_background(svc, payload: dict) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def call():
        r = svc.client.post("/v1/completions", json=payload, timeout=60)
        out["status"], out["headers"], out["body"] = r.status_code, r.headers, r.json()

    t = threading.Thread(target=call)
    t.start()
    wait_until(lambda: svc.metric("v100plan_requests_running") == 1, 10, what="the request to run")
    return t, out


def _stream_until_fault(svc, payload: dict, inject, after_chunks: int = 2) -> tuple[str, list[dict]]:
    """Stream, inject after a few chunks, return (text received, the data events after it)."""
    text, tail, injected = "", [], False
    with svc.client.stream("POST", "/v1/completions", json={**payload, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                tail.append({"done": True})
                break
            event = json.loads(line[6:])
            if "error" in event:
                tail.append(event)
                continue
            text += event["choices"][0]["text"]
            chunks += 1
            if chunks == after_chunks and not injected:
                inject()
                injected = True
    return text, tail


def test_kill_rank0_mid_stream_gives_sse_error_then_done(svc):
    before = svc.wait_healthy()
    text, tail = _stream_until_fault(svc, LONG, lambda: svc.inject("kill", rank=0))
    assert tail[-1] == {"done": True}
    errors = [e["error"] for e in tail if "error" in e]
    assert len(errors) == 1 and errors[0]["code"] == 503 and "restarting" in errors[0]["message"]
    # Whatever was streamed before the fault was right: a prefix of the reference.
    ref = tp1_reference(tuple(prompt_ids("Long story")), 200)
    assert tokenizer().decode(ref["token_ids"]).startswith(text) and text
    _assert_recovered(svc, before, "exit")


def test_kill_rank1_mid_request_gives_503_json(svc):
    before = svc.wait_healthy()
    t, out = _in_background(svc, LONG)
    svc.inject("kill", rank=1)
    t.join()
    assert out["status"] == 503 and out["body"]["error"]["type"] == "service_unavailable"
    assert "rank 1" in out["body"]["error"]["message"] and int(out["headers"]["Retry-After"]) >= 1
    _assert_recovered(svc, before, "exit")


def test_freeze_rank1_mid_request(svc):
    before = svc.wait_healthy()
    t, out = _in_background(svc, LONG)
    svc.inject("freeze", rank=1)
    t.join()
    assert out["status"] == 503
    # Rank 1's heartbeat stops (liveness), rank 0's allreduce times out (4 s) and it reports
    # fatal, or the stall timeout fires: whichever comes first.
    _assert_recovered(svc, before, ("exit", "stall", "liveness"))


def test_frozen_idle_rank_turns_health_false_then_recovers(svc):
    before = svc.wait_healthy()
    svc.inject("freeze", rank=0)
    # No request is running: its missing heartbeat (or the unanswered idle ping) finds it.
    wait_until(lambda: svc.health().status_code == 503, STALL_S + 4, what="/health to say 503")
    assert svc.complete(PROMPT, 4).status_code == 503
    # /health turns 503 the moment a rank is known dead, before the failure line is written: read
    # the cause after recovery, for this generation only.
    _assert_recovered(svc, before, ("stall", "liveness"))


def test_corrupt_hash_is_a_lockstep_failure_and_no_wrong_token_is_served(svc):
    before = svc.wait_healthy()
    lockstep_before = svc.metric("v100plan_lockstep_failures_total")
    text, tail = _stream_until_fault(svc, LONG, lambda: svc.inject("corrupt_hash", rank=1))
    assert tail[-1] == {"done": True} and any("error" in e for e in tail)
    ref = tp1_reference(tuple(prompt_ids("Long story")), 200)
    assert tokenizer().decode(ref["token_ids"]).startswith(text)
    failure = [e for e in svc.events("rank_failure") if e["generation"] == before["generation"]][-1]
    assert "LOCKSTEP FAILURE" in failure["reason"]
    assert svc.metric("v100plan_lockstep_failures_total") == lockstep_before + 1
    _assert_recovered(svc, before, "lockstep")


def test_stalled_allreduce_on_one_rank(svc):
    before = svc.wait_healthy()
    svc.inject("stall_allreduce", rank=1)
    r = svc.complete("Long story", 50)
    assert r.status_code == 503
    _assert_recovered(svc, before, ("exit", "stall", "liveness"))


def test_control_targets_and_refusals(svc):
    t = svc.targets()
    assert t["state"] == "up" and [r["rank"] for r in t["ranks"]] == [0, 1]
    assert all(r["alive"] for r in t["ranks"]) and t["proxy_pid"] == svc.proc.pid
    r = svc.client.post("/control/inject", json={"action": "kill"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rank"
    r = svc.client.post("/control/inject", json={"action": "format_disk", "rank": 0})
    assert r.status_code == 400
