"""The service under attack, lifecycle part, plus per-token streaming and the start-up refusals:
SIGTERM drains (running requests end with 503 JSON or an SSE error + [DONE]) and exits 0,
Ctrl-C is quiet, one serve per state directory, stale runs reaped, mailbox names nobody can
guess, a failed start on one rank ends the other at once, --device cuda without CUDA exits 4.

The service here serves a copy of the demo model WITHOUT tokenizer.json: its streams carry
token ids, one event per token."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.test_service_support import (
    REPO,
    ServiceProcess,
    demo_model,
    free_port,
    pid_alive,
    service_fixture,
    short_dir,
    wait_until,
)

pytestmark = pytest.mark.slow

MODEL_ID = "no-tokenizer"
TOKENS = 300


@functools.lru_cache(maxsize=1)
def bare_model() -> str:
    out = os.path.join(short_dir("bare"), MODEL_ID)
    shutil.copytree(demo_model(), out)
    os.remove(os.path.join(out, "tokenizer.json"))
    return out


svc = service_fixture("--served-model-name", MODEL_ID, "--drain-timeout-s", "1.5", model=bare_model,
                      stall_timeout_s=60, allreduce_timeout_s=30)


def _long(stream: bool, n: int = TOKENS) -> dict:
    return {"model": MODEL_ID, "prompt": [1, 40, 41, 42], "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def _sse_events(svc, payload: dict, on_event=None) -> list[tuple[float, dict | str]]:
    """(arrival time, event) for each SSE data line, as it arrives."""
    out = []
    with svc.client.stream("POST", "/v1/completions", json=payload, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            event = data if data == "[DONE]" else json.loads(data)
            out.append((time.monotonic(), event))
            if on_event is not None:
                on_event(len(out), event)
    return out


# ----- per-token streaming --------------------------------------------------------------------


def test_a_model_without_tokenizer_streams_one_event_per_token_as_it_is_made(svc):
    t0 = time.monotonic()
    events = _sse_events(svc, _long(True))
    t_end = events[-1][0]
    assert events[-1][1] == "[DONE]"
    per_token = [(t, e) for t, e in events[:-1] if e["v100plan"].get("token_ids") and e["choices"][0]["finish_reason"] is None]
    final = events[-2][1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert [e["v100plan"]["token_ids"][0] for _, e in per_token] == final["v100plan"]["token_ids"]
    assert len(per_token) == TOKENS and all(len(e["v100plan"]["token_ids"]) == 1 for _, e in per_token)
    # The gaps between events: tokens arrive while the ranks decode, not all at the end.
    arrivals = [t for t, _ in per_token]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    total = t_end - t0
    assert arrivals[0] - t0 < 0.5 * total, (arrivals[0] - t0, total)
    assert arrivals[TOKENS // 2] - t0 < 0.85 * total
    assert sum(g > 0 for g in gaps) > TOKENS // 2
    print(f"\n{TOKENS} token events in {total:.2f} s; first after {arrivals[0] - t0:.3f} s; "
          f"median gap {sorted(gaps)[len(gaps) // 2] * 1000:.2f} ms, max gap {max(gaps) * 1000:.1f} ms")


# ----- finding 5: mailbox and rendezvous names --------------------------------------------------


def test_mailbox_names_are_secret_per_start_and_the_key_file_private(tmp_path):
    from engine.allreduce import host_mailbox
    from engine.service.proxy_ranks import MAILBOX_GLOB, new_mailbox_key

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(mode=0o700)
    b.mkdir(mode=0o700)
    key = new_mailbox_key(str(a))
    assert len(key) == 32 and stat.S_IMODE(os.stat(a / "mailbox.key").st_mode) == 0o600
    name = host_mailbox.mailbox_file(str(a), 3, 1)
    assert key in name and os.path.basename(name).startswith(MAILBOX_GLOB.split("{")[0])
    os.rmdir(os.path.dirname(name))  # the start's private mailbox directory
    # Without a key file the first rank to look creates one; both ranks, racing, read the same.
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(host_mailbox.mailbox_key(str(b)))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and got[0] != key
    shutil.rmtree(host_mailbox.private_dir(got[0]))
    assert stat.S_IMODE(os.stat(b / "mailbox.key").st_mode) == 0o600
    assert sorted(os.listdir(b)) == ["mailbox.key"]


def test_a_failed_start_on_one_rank_brings_the_other_down_at_once():
    import argparse

    from engine.service.proxy_ranks import RankStartError, start_pair
    from engine.service.serve_config import add_serve_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    # Rank 1 cannot start (no CUDA here); rank 0 would wait for it at the rendezvous for 60 s.
    cfg = config_from_args(p.parse_args(["--model", bare_model(), "--device", "cpu,cuda:0", "--dtype", "float32",
                                         "--state-dir", short_dir("failstart"), "--allreduce-timeout-s", "60"]))
    t0 = time.monotonic()
    with pytest.raises(RankStartError, match="rank 1"):
        asyncio.run(start_pair(cfg, 1))
    assert time.monotonic() - t0 < 30
    assert not os.path.exists(os.path.join(cfg.state_dir, "run", "g1"))


# ----- finding 11: one serve per state directory; per-instance default ----------------------------


def test_a_second_serve_on_the_same_state_dir_is_refused(svc):
    r = subprocess.run([sys.executable, "-m", "engine", "serve", "--model", bare_model(), "--port", str(free_port()),
                        "--state-dir", svc.state_dir], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 4 and "another serve" in r.stderr and str(svc.proc.pid) in r.stderr


def test_default_state_dir_is_per_port(monkeypatch, tmp_path):
    from engine.service.serve_config import default_state_dir

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_state_dir(8000) != default_state_dir(8001)
    assert default_state_dir(8001).startswith(str(tmp_path))


# ----- refusals at start ------------------------------------------------------------------------


def test_device_cuda_without_cuda_fails_at_once_with_exit_4():
    t0 = time.monotonic()
    state = short_dir("nocuda")
    r = subprocess.run([sys.executable, "-m", "engine", "serve", "--model", bare_model(), "--device", "cuda",
                        "--port", str(free_port()), "--state-dir", state],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 4 and "CUDA is not available" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 30  # no rank start was tried (each costs seconds), no 15 s retry loop
    # the fork server serve started first (its torch import overlaps the checks) went with it
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                left += [pid] if state.encode() in fh.read() else []
        except OSError:
            pass
    assert not left


def test_ctrl_c_while_starting_is_quiet_and_exits_0():
    s = ServiceProcess(model=bare_model())
    try:
        wait_until(lambda: s.events("serve_start"), 60, what="serve to start")
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(30) == 0
        text = s.log_text()
        assert "Traceback" not in text and "KeyboardInterrupt" not in text
        assert s.events("serve_exit")[-1]["code"] == 0
    finally:
        s.stop()


# ----- finding 8: SIGTERM drains with a bound and exits 0 ----------------------------------------


def test_sigterm_drains_ends_running_requests_with_503_and_exits_0(svc):
    pids = svc.client.get("/health").json()["rank_pids"]
    got_tokens = threading.Event()
    stream_out: dict = {}
    plain_out: dict = {}
    big = 2000  # cannot finish inside the 1.5 s drain on any machine

    def stream():
        stream_out["events"] = _sse_events(svc, _long(True, big),
                                           on_event=lambda n, e: got_tokens.set() if n >= 3 else None)

    def plain():
        r = svc.client.post("/v1/completions", json=_long(False, big), timeout=120)
        plain_out.update(status=r.status_code, body=r.json(), type=r.headers["content-type"])

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    threads[0].start()
    assert got_tokens.wait(30)
    threads[1].start()
    wait_until(lambda: svc.metric("v100plan_queue_depth") == 1, 10, 0.02, what="the second request to queue")
    t0 = time.monotonic()
    svc.proc.send_signal(signal.SIGTERM)
    late = wait_until(lambda: _try_post(svc), 5, 0.05, what="an answer during the drain")
    assert svc.proc.wait(30) == 0
    took = time.monotonic() - t0
    for t in threads:
        t.join(30)
    assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
    events = stream_out["events"]
    assert events[-1][1] == "[DONE]"
    err = events[-2][1]
    assert err["error"]["code"] == 503 and "shutting down" in err["error"]["message"]
    assert plain_out["status"] == 503 and plain_out["type"].startswith("application/json")
    assert "shutting down" in plain_out["body"]["error"]["message"]
    assert took < 10, took  # 1.5 s drain + closing
    names = [e["event"] for e in svc.events()]
    after = names[names.index("signal"):]
    assert after[-1] == "serve_exit" and svc.events("serve_exit")[-1]["code"] == 0
    assert "rank_failure" not in after and "restart" not in after
    for pid in pids:
        wait_until(lambda p=pid: not pid_alive(p), 10, what=f"rank {pid} to exit")
    assert not os.listdir(os.path.join(svc.state_dir, "run"))


def _try_post(svc):
    try:
        return httpx.post(svc.url + "/v1/completions", json=_long(False, 4), timeout=5)
    except httpx.TransportError:
        return None
