"""The service findings of a local attack (2026-12-01), each a test that failed before its fix:
a start-up self-test failure on one rank costs milliseconds and both ranks agree on it; the
connection cap's 503 carries Retry-After and is counted and logged; a keyed service's
/openapi.json lists no /control route; fault injection needs an API key; protocol-level 400s
are the documented JSON errors; `ps` tells rank 0 from rank 1; state directories and their
entries that another user could have made are refused; mailbox names cannot be pre-created."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time

import httpx
import pytest

from tests.test_service_support import demo_model, service_fixture, short_dir, wait_until

pytestmark = pytest.mark.slow


def _cfg(*flags: str):
    from engine.service.serve_config import add_serve_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return config_from_args(p.parse_args(["--model", demo_model(), "--device", "cpu", *flags]))


def test_a_selftest_failure_on_one_rank_costs_milliseconds_and_both_ranks_agree():
    from engine.service.causes import Cause
    from engine.service.proxy_ranks import RankStartError, start_pair

    key_file = os.path.join(short_dir("selftest-key"), "key")
    with os.fdopen(os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as fh:
        fh.write("sk-selftest\n")
    cfg = _cfg("--state-dir", short_dir("selftest"), "--allreduce-timeout-s", "60", "--enable-fault-injection",
               "--api-key-file", key_file)
    fail = ("--fail-selftest", "host_mailbox", "--fail-selftest", "gloo")
    t0 = time.monotonic()
    with pytest.raises(RankStartError) as err:
        asyncio.run(start_pair(cfg, 1, rank1_extra=fail))
    took = time.monotonic() - t0
    assert err.value.cause is Cause.SELFTEST, err.value
    # Before: rank 0 waited in gather_last for the peer that had already left: the whole 60 s timeout.
    assert took < 30, took
    logs = {r: open(os.path.join(cfg.state_dir, "logs", f"rank{r}.g1.log")).read() for r in (0, 1)}
    for r in (0, 1):  # the same verdict on both ranks, naming the rank whose check failed
        assert "allreduce self-test host_mailbox: rank 1: allreduce_sum of 8k known data is not bit-exact" \
            in logs[r], logs[r]
        assert "no allreduce path passed its self-test" in logs[r]
        assert "timed out" not in logs[r] and "mismatch" not in logs[r]
    print(f"\na failed self-test on rank 1: the start failed after {took:.2f} s (allreduce timeout 60 s)")


# ----- one keyed service with fault injection and a small connection cap ------------------------------

KEY = "sk-findings-5d1c"
CAP = 3
svc = service_fixture("--enable-fault-injection", "--max-connections", str(CAP), api_key=KEY)


def _raw(svc, data: bytes, timeout: float = 5.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", svc.port), timeout=timeout)
    s.sendall(data)
    return s


def _reply(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    s.close()
    return out


def test_the_fault_hooks_answer_the_key_holder_only(svc):
    r = httpx.post(f"{svc.url}/control/inject", json={"action": "kill", "rank": 0}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{svc.url}/control/events", timeout=10).status_code == 401
    assert svc.client.get("/control/targets").status_code == 200


def test_openapi_lists_no_control_route(svc):
    doc = httpx.get(f"{svc.url}/openapi.json", timeout=10).json()
    assert "/v1/completions" in doc["paths"]
    assert not [p for p in doc["paths"] if p.startswith("/control")], list(doc["paths"])


def test_the_connection_cap_503_has_retry_after_and_is_counted_and_logged(svc):
    before = svc.metric("v100plan_connections_refused_total")
    held = [_raw(svc, b"GET /health HTTP/1.1\r\nHost: x\r\n") for _ in range(CAP + 4)]
    refused = []
    for s in held[CAP + 1:]:
        s.settimeout(2.0)
        try:
            head = s.recv(4096)
        except socket.timeout:
            continue
        if head.startswith(b"HTTP/1.1 503"):
            refused.append(head)
    for s in held:
        s.close()
    assert refused, "no connection over the cap was refused"
    for head in refused:
        assert b"\r\nretry-after: 1\r\n" in head.lower() and b'"code": 503' in head, head
    wait_until(lambda: (svc.health() or httpx.Response(0)).status_code == 200, 20, what="health after the cap")
    assert svc.metric("v100plan_connections_refused_total") >= before + len(refused)
    lines = svc.events("connections_refused")
    assert lines and lines[-1]["max_connections"] == CAP and lines[-1]["count"] >= 1


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"GET /health HTTP/1.1\r\n X-Folded: a\r\nHost: x\r\n\r\n",  # a folded line h11 cannot join
    b"GET /health HTTP/1.1\r\n\r\n",
], ids=["bad_chunk_size", "negative_content_length", "obs_fold", "no_host"])
def test_protocol_level_400s_are_the_documented_json_errors(svc, request_bytes):
    reply = _reply(_raw(svc, request_bytes))
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), reply[:300]
    assert b"content-type: application/json" in head.lower(), head
    err = json.loads(body)["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error" and "HTTP/1.1" in err["message"]
