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
import subprocess
import sys
import time

import httpx
import pytest

from tests.test_service_support import (
    REPO,
    demo_model,
    keyed_idle,
    raw_request,
    read_all,
    service_fixture,
    short_dir,
    wait_until,
)

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


def test_the_fault_hooks_answer_the_key_holder_only(svc):
    r = httpx.post(f"{svc.url}/control/inject", json={"action": "kill", "rank": 0}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{svc.url}/control/events", timeout=10).status_code == 401
    assert svc.client.get("/control/targets").status_code == 200


def test_openapi_lists_no_control_route(svc):
    assert httpx.get(f"{svc.url}/openapi.json", timeout=10).status_code == 401  # the schema needs the key
    doc = svc.client.get("/openapi.json").json()
    assert "/v1/completions" in doc["paths"]
    assert not [p for p in doc["paths"] if p.startswith("/control")], list(doc["paths"])


def test_the_connection_cap_503_has_retry_after_and_is_counted_and_logged(svc):
    before = svc.metric("v100plan_connections_refused_total")
    # CAP connections that showed the key (never closed to make room: test_service_exposure.py), then more
    held = [keyed_idle(svc, KEY) for _ in range(CAP)]
    held += [raw_request(svc, b"GET /health HTTP/1.1\r\nHost: x\r\n") for _ in range(4)]
    refused = []
    for s in held[CAP:]:
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
    reply = read_all(raw_request(svc, request_bytes))
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), reply[:300]
    assert b"content-type: application/json" in head.lower(), head
    err = json.loads(body)["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error" and "HTTP/1.1" in err["message"]


def test_ps_tells_rank_0_from_rank_1(svc):
    pids = svc.wait_healthy()["rank_pids"]
    for rank, pid in enumerate(pids):
        with open(f"/proc/{pid}/comm") as fh:
            assert fh.read().strip() == f"v100plan-rank{rank}"
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            assert fh.read().startswith(f"v100plan-engine rank {rank} generation ".encode())


# ----- finding 1: a state directory another user could have prepared -------------------------------


def _serve_on(state_dir: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", "serve", "--model", demo_model(), "--port", "9",
                           "--state-dir", state_dir], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_a_state_dir_others_can_write_or_own_or_link_into_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    r = _serve_on(str(shared))
    assert r.returncode == 2 and "writable by other users" in r.stderr and "chmod 700" in r.stderr, r.stderr
    # another user's directory (made here as root, given to uid 1005)
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 1005, 1005)
    r = _serve_on(str(foreign))
    assert r.returncode == 2 and "belongs to uid 1005" in r.stderr, r.stderr
    # a link inside: serve must not reap "stale runs" through it
    victim = tmp_path / "victim"
    (victim / "precious").mkdir(parents=True)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    os.symlink(victim, mine / "run")
    r = _serve_on(str(mine))
    assert r.returncode == 2 and "symbolic link" in r.stderr and str(mine / "run") in r.stderr, r.stderr
    assert (victim / "precious").is_dir()
    r = subprocess.run([sys.executable, "-m", "engine", "supervise", "start", "--state-dir", str(mine), "--",
                        "--model", demo_model()], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "symbolic link" in r.stderr, r.stderr


def test_supervise_stop_signals_a_pid_only_when_it_is_provably_ours(tmp_path):
    from engine.service.state_dir import ID_ENV, service_id, start_time

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    stranger = subprocess.Popen(["sleep", "60"], env={**os.environ, ID_ENV: service_id(str(state))})
    mine = subprocess.Popen(["sleep", "60"], env={**os.environ, ID_ENV: service_id(str(state))})
    try:
        # service.json names both, each carrying the state dir's secret (tests/service/test_service_identity.py
        # has those that do not); only `mine` has the start time recorded when it was ours
        doc = {"proxy_pid": None, "rank_pids": [stranger.pid, mine.pid],
               "start_times": {str(stranger.pid): 12345, str(mine.pid): start_time(mine.pid)}}
        (state / "service.json").write_text(json.dumps(doc))
        r = subprocess.run([sys.executable, "-m", "engine", "supervise", "stop", "--state-dir", str(state)],
                           cwd=REPO, capture_output=True, text=True, timeout=90)
        out = json.loads(r.stdout)
        assert out["had_to_kill"] == ["rank1"] and out["not_ours"] == ["rank0"], out
        assert mine.wait(10) == -9
        assert stranger.poll() is None  # left alone: its start time is not the recorded one
    finally:
        for p in (stranger, mine):
            p.kill()
            p.wait()


# ----- finding 6: mailbox names nobody else can see or pre-create -----------------------------------


def test_mailbox_files_live_in_a_private_directory_of_the_start(tmp_path):
    import shutil
    import stat

    from engine.allreduce import host_mailbox
    from engine.allreduce.base import PathError
    from engine.service.proxy_ranks import new_mailbox_key, remove_run_dir

    run = tmp_path / "run"
    (run / "rdv").mkdir(parents=True, mode=0o700)
    key = new_mailbox_key(str(run / "rdv"))
    name = host_mailbox.mailbox_file(str(run / "rdv"), 3, 1)
    folder = os.path.dirname(name)
    st = os.lstat(folder)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    host_mailbox._create(name, 64)
    # a listing of the shared directory shows no file name of this start, only its closed directory
    shared = os.path.dirname(folder)
    assert [n for n in os.listdir(shared) if key in n] == [os.path.basename(folder)]
    remove_run_dir(str(run))  # the proxy's clean-up after killed ranks takes the directory along
    assert not os.path.exists(folder)
    # a directory of that name that is not this user's private one is refused, never used
    other = tmp_path / "other-rdv"
    other.mkdir(mode=0o700)
    trap = os.path.join(shared, f"v100plan-mbox-{new_mailbox_key(str(other))}")
    os.mkdir(trap, 0o777)
    os.chown(trap, 1005, 1005)
    try:
        with pytest.raises(PathError, match="not this user's private directory"):
            host_mailbox.mailbox_file(str(other), 1, 0)
    finally:
        shutil.rmtree(trap)
