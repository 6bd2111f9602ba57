"""The service's process lifecycle: refusals at start, the restart cap, and supervisord bringing a
killed proxy back; `supervise stop` leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.test_service_support import (
    MODEL_ID,
    REPO,
    ServiceProcess,
    demo_model,
    expected_tokens,
    free_port,
    pid_alive,
    prompt_ids,
    short_dir,
    wait_until,
)

pytestmark = pytest.mark.slow


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", "serve", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_refuses_public_bind_without_key_and_other_tp():
    r = _serve("--model", demo_model(), "--host", "0.0.0.0", "--port", str(free_port()))
    assert r.returncode == 2 and "without --api-key-file" in r.stderr
    r = _serve("--model", demo_model(), "--tp", "1")
    assert r.returncode == 2 and "--tp 2" in r.stderr
    # Fault hooks without a key would let every local user kill the ranks.
    r = _serve("--model", demo_model(), "--enable-fault-injection")
    assert r.returncode == 2 and "--enable-fault-injection needs --api-key-file" in r.stderr
    r = _serve("--model", "/nonexistent/model")
    assert r.returncode == 2 and "config.json" in r.stderr


def test_restart_cap_exits_non_zero():
    # A private copy of the model that we break after the first start: every restart then fails.
    model = os.path.join(short_dir("broken"), "demo")
    shutil.copytree(demo_model(), model)
    svc = ServiceProcess("--enable-fault-injection", "--max-restarts", "2", model=model)
    try:
        first = svc.wait_healthy()
        os.remove(os.path.join(model, "model.safetensors"))
        svc.inject("kill", rank=0)
        assert svc.proc.wait(90) == 3
        failed = svc.events("rank_start_failed")
        assert [e["consecutive_failures"] for e in failed] == [1, 2, 3]
        assert all(e["generation"] > first["generation"] for e in failed)
        exit_line = svc.events("exit")[-1]
        assert exit_line["code"] == 3 and "3 consecutive failed rank starts" in exit_line["reason"]
        for pid in first["rank_pids"]:
            assert not pid_alive(pid)
    finally:
        svc.stop()


def _supervise(*args: str, timeout: float = 120) -> dict:
    r = subprocess.run([sys.executable, "-m", "engine", "supervise", *args], cwd=REPO, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_supervisord_restarts_a_killed_proxy_and_stop_leaves_nothing():
    state = short_dir("sup")
    port = free_port()
    key_file = os.path.join(short_dir("supkey"), "key")
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("sk-supervised-test\n")
    started = _supervise("start", "--state-dir", state, "--wait-healthy-s", "90", "--",
                         "--model", demo_model(), "--port", str(port), "--enable-fault-injection",
                         "--api-key-file", key_file, "--stall-timeout-s", "5")
    try:
        assert started["program_state"] in ("STARTING", "RUNNING") and started["health_status"] == 200
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60,
                              headers={"Authorization": "Bearer sk-supervised-test"})
        before = client.get("/control/targets").json()
        old_ranks = [r["pid"] for r in before["ranks"]]
        client.post("/control/inject", json={"action": "kill_proxy"})
        wait_until(lambda: not pid_alive(before["proxy_pid"]), 10, what="the proxy to die")
        # The ranks die with their parent (PR_SET_PDEATHSIG), so no orphan holds the device.
        for pid in old_ranks:
            wait_until(lambda p=pid: not pid_alive(p), 10, what=f"orphan rank {pid} to be gone")

        def back():
            try:
                # Health first: targets read before the new pair is up would list no ranks yet.
                h = client.get("/health")
                t = client.get("/control/targets").json()
            except httpx.TransportError:
                return None
            up = h.status_code == 200 and t["state"] == "up" and t["ranks"]
            return t if up and t["proxy_pid"] != before["proxy_pid"] else None

        after = wait_until(back, 90, 0.3, "supervisord to bring the proxy back")
        assert after["generation"] > before["generation"]
        # The killed proxy could not clean up: the new one reaped its run directory at start.
        assert not os.path.exists(os.path.join(state, "run", f"g{before['generation']}"))
        assert '"event":"reaped_stale_runs"' in open(os.path.join(state, "logs", "serve.stderr.log")).read()
        ids = prompt_ids("Once upon")
        r = client.post("/v1/completions", json={"model": MODEL_ID, "prompt": "Once upon", "max_tokens": 8,
                                                 "temperature": 0})
        assert r.json()["v100plan"]["token_ids"] == expected_tokens(ids, 8)
        status = _supervise("status", "--state-dir", state)
        assert status["running"] and status["proxy_pid"] == after["proxy_pid"]
        assert status["rank_pids"] == [r["pid"] for r in after["ranks"]]
        client.close()
    finally:
        stopped = _supervise("stop", "--state-dir", state)
    assert stopped["left_running"] == [] and stopped["had_to_kill"] == []
    assert set(stopped["stopped"]) == {"supervisord", "proxy", "rank0", "rank1"}
    time.sleep(0.2)
    for pid in stopped["stopped"].values():
        assert not pid_alive(pid)
    # `stop` reached the proxy first: it drained and stopped its watchdog before its ranks, so the
    # shutdown is no rank failure and starts no new generation.
    lines = [json.loads(x) for x in open(os.path.join(state, "logs", "serve.stderr.log")) if x.startswith("{")]
    last_run = lines[max(i for i, e in enumerate(lines) if e["event"] == "serve_start"):]
    events = [e["event"] for e in last_run]
    assert "signal" in events and events[-1] == "serve_exit" and last_run[-1]["code"] == 0, events
    after_signal = events[events.index("signal"):]
    assert "rank_failure" not in after_signal and "restart" not in after_signal, after_signal


def test_a_serve_that_cannot_serve_here_is_left_down_and_start_says_why_at_once():
    # serve's exit 4 (here: CUDA asked for on a host without it) is not mended by a restart: supervisord
    # leaves it EXITED and `supervise start` fails with serve's own message instead of waiting out
    # --wait-healthy-s while the proxy is restarted over and over.
    state = short_dir("supdown")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "engine", "supervise", "start", "--state-dir", state,
                        "--wait-healthy-s", "120", "--", "--model", demo_model(), "--port", str(free_port()),
                        "--device", "cuda:0,cuda:1"], cwd=REPO, capture_output=True, text=True, timeout=150)
    took = time.monotonic() - t0
    try:
        assert r.returncode != 0
        assert "exited and is not restarted" in r.stderr and "CUDA" in r.stderr, r.stderr[-2000:]
        assert took < 60, f"start took {took:.1f} s to give up on a serve that cannot run here"
        assert not os.path.exists(os.path.join(state, "supervisord.pid")) or _supervisord_gone(state)
    finally:
        subprocess.run([sys.executable, "-m", "engine", "supervise", "stop", "--state-dir", state], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
        shutil.rmtree(state, ignore_errors=True)


def _supervisord_gone(state: str) -> bool:
    try:
        pid = int(open(os.path.join(state, "supervisord.pid")).read().strip())
    except (OSError, ValueError):
        return True
    return not pid_alive(pid)


def test_systemd_unit_runs_serve_and_kills_the_cgroup():
    unit = _supervise("unit", "--state-dir", "/var/lib/v100plan", "--", "--model", demo_model(), "--port", "8123")
    text = unit["unit"]
    assert "ExecStart=" in text and " -m engine serve --model " in text and "--state-dir /var/lib/v100plan" in text
    assert "Restart=always" in text and "KillMode=mixed" in text


def test_the_fork_server_reports_its_ranks_exit_and_takes_them_along(tmp_path):
    from engine.service.proxy_ranks import die_with_parent, rank_env
    from engine.service.rank_forks import RankForks

    rendezvous, sock = short_dir("rdv"), os.path.join(short_dir("sock"), "r0.sock")
    lone_rank = ["--model", demo_model(), "--rank", "0", "--world", "2", "--rendezvous", rendezvous,
                 "--control-socket", sock, "--allreduce", "gloo", "--allreduce-timeout-s", "120"]

    async def scenario():
        forks = RankForks(str(tmp_path / "forks.log"), die_with_parent, rank_env())
        await forks.start()
        bad = await forks.fork(["--no-such-flag"], str(tmp_path / "bad.log"))
        assert await asyncio.wait_for(bad.wait(), 60) == 2  # argparse's exit code, from the fork server
        assert "arguments are required" in (tmp_path / "bad.log").read_text()  # its log is the rank's
        lone = await forks.fork(lone_rank, str(tmp_path / "lone.log"))  # waits for a peer that never comes
        await asyncio.sleep(1.0)
        assert lone.returncode is None and pid_alive(lone.pid)
        os.kill(forks.proc.pid, signal.SIGKILL)
        assert await asyncio.wait_for(lone.wait(), 10) == -signal.SIGKILL  # the kernel's parent-death signal
        wait_until(lambda: not pid_alive(lone.pid), 10, what="the forked rank to be gone")
        await asyncio.wait_for(forks._reader, 10)
        assert not forks.alive and await forks.fork(lone_rank, str(tmp_path / "again.log")) is None
        await forks.close()

    asyncio.run(scenario())


def test_the_last_exit_is_read_from_this_supervisords_log_only(tmp_path):
    from engine.service import supervise

    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "supervisord.log"
    assert supervise._last_exit(str(tmp_path)) is None  # no log yet
    log.write_text("2026-12-04 01:00:00,000 INFO supervisord started with pid 10\n"
                   "2026-12-04 01:00:01,000 WARN exited: engine (exit status 4; not expected)\n"
                   "2026-12-04 01:05:00,000 INFO supervisord started with pid 20\n"
                   "2026-12-04 01:05:01,000 INFO spawned: 'engine' with pid 21\n")
    assert supervise._last_exit(str(tmp_path)) is None  # the 4 was an earlier supervisord's
    with log.open("a") as fh:
        fh.write("2026-12-04 01:05:02,000 WARN exited: engine (exit status 1; not expected)\n"
                 "2026-12-04 01:05:04,000 WARN exited: engine (exit status 2; not expected)\n")
    assert supervise._last_exit(str(tmp_path)) == 2
