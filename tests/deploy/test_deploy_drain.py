"""A switch lets the old release finish what it is answering: a stream that goes on for more than 10 s after
a rollback switched the front (the engine's own drain is 10 s) arrives whole, token for token, against the
real sshd and the demo model.

The demo model decodes hundreds of tokens a second on CPU, so the stream is slowed where it is made: the
test pauses the old release's two rank processes (SIGSTOP, SIGCONT; 0.6 s at a time, well inside the
watchdog's 2.5 s liveness limit) until the stream has lasted 12 s past the switch.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import threading
import time

import pytest

from tests import sshd as sshd_mod
from tests.deploy_support import *  # noqa: F403 - the shared fixtures
from tests.deploy_support import live_slot, module_env

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sshd_mod.available() is not None, reason=str(sshd_mod.available()))]

DEP = f"drain-{os.getpid()}"
PROMPT = "The operator watches the stream"


def _deploy(cli, server, port, model, *extra):
    return cli("deploy", server.host_spec, "--model", model, "--deployment", DEP, "--port", port,
               "--health-timeout", "120", "--json", *extra)


@pytest.fixture(scope="module")
def two_releases(tmp_path_factory, server, port, demo_model, bundle_snapshot, local_home):
    from tests.conftest import Cli

    with module_env(server, tmp_path_factory, bundle_snapshot, local_home) as root:
        for extra in (["--max-context", "4000"], ["--max-context", "3950"]):
            r = _deploy(Cli(), server, port, demo_model, *extra)
            assert r.exit_code == 0, r.stderr
        yield {"dir": root / DEP}
        Cli()("stop", server.host_spec, "--deployment", DEP)


def _post(port: int, key: str, body: dict) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    return conn.getresponse()


def _model(port: int, key: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
    return json.loads(conn.getresponse().read())["data"][0]["id"]


class Stream(threading.Thread):
    """One streamed completion read event by event: its token ids, any error event, when it ended."""

    def __init__(self, port: int, key: str, model: str, max_tokens: int):
        super().__init__(daemon=True)
        self.port, self.key, self.model, self.max_tokens = port, key, model, max_tokens
        self.ids: list[int] = []
        self.errors: list[dict] = []
        self.done = False
        self.started = self.ended = None

    def run(self) -> None:
        self.started = time.monotonic()
        resp = _post(self.port, self.key, {"model": self.model, "prompt": PROMPT, "max_tokens": self.max_tokens,
                                           "temperature": 0, "ignore_eos": True, "stream": True})
        try:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.done = True
                    break
                doc = json.loads(line[6:])
                if "error" in doc:
                    self.errors.append(doc)
                elif doc.get("choices") and doc["choices"][0].get("finish_reason") is None:
                    self.ids += doc["v100plan"]["token_ids"]
        finally:
            self.ended = time.monotonic()


def test_a_stream_longer_than_10_s_survives_a_rollback_token_for_token(cli, env, two_releases, server, port):
    dep = two_releases["dir"]
    key = (dep / "api_key").read_text().strip()
    old_slot = live_slot(dep)
    ranks = json.loads((old_slot / "service.json").read_text())["rank_pids"]
    model = _model(port, key)

    t0 = time.monotonic()
    ref = json.loads(_post(port, key, {"model": model, "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
                                       "ignore_eos": True}).read())
    rate = 400 / (time.monotonic() - t0)
    max_tokens = int(min(3800, max(600, rate * 20)))

    stream = Stream(port, key, model, max_tokens)
    switched: dict[str, float] = {}
    stop_pacing = threading.Event()

    def pace() -> None:
        """Pause the old release's ranks while the stream runs, until it has lasted 12 s past the switch."""
        while not stop_pacing.is_set() and not stream.done:
            if live_slot(dep) != old_slot and "at" not in switched:
                switched["at"] = time.monotonic()
            if "at" in switched and time.monotonic() - switched["at"] > 12:
                return
            for sig in (signal.SIGSTOP, signal.SIGCONT):
                for pid in ranks:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                if sig == signal.SIGSTOP:
                    time.sleep(0.6)
            time.sleep(0.1)

    pacer = threading.Thread(target=pace, daemon=True)
    stream.start()
    time.sleep(0.5)
    pacer.start()
    try:
        r = cli("rollback", server.host_spec, "--deployment", DEP, "--json")
    finally:
        stream.join(600)
        stop_pacing.set()
        pacer.join(30)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert "at" in switched, "the rollback never switched the front"
    after_switch = stream.ended - switched["at"]
    print(f"stream of {max_tokens} tokens: {stream.ended - stream.started:.1f} s, {after_switch:.1f} s of it after "
          f"the switch; drain {doc.get('drain')}")
    assert after_switch > 10, after_switch  # longer than the engine's own 10 s drain
    assert stream.errors == [] and stream.done, stream.errors
    resp = _post(port, key, {"model": _model(port, key), "prompt": PROMPT, "max_tokens": max_tokens,
                             "temperature": 0, "ignore_eos": True})
    body = json.loads(resp.read())
    assert resp.status == 200, body
    want = body["v100plan"]["token_ids"]
    assert stream.ids == want  # every token, in order: the same model's greedy answer on the new release
    assert want[:400] == ref["v100plan"]["token_ids"]
    assert doc["drain"]["drained"] is True and doc["drain"]["waited_s"] > 10, doc["drain"]
    assert live_slot(dep) != old_slot


def _accepts(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_a_killed_front_is_back_within_5_s_and_status_says_degraded_meanwhile(cli, env, two_releases, server,
                                                                               port):
    run = two_releases["dir"] / "run"
    rec = json.loads((run / "front.json").read_text())
    assert cli.json("status", server.host_spec, "--deployment", DEP)["state"] == "healthy"

    # 1. SIGKILL the front (the process that holds the port): its keeper starts it again
    os.kill(rec["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    while not (_accepts(port) and json.loads((run / "front.json").read_text())["pid"] != rec["pid"]):
        assert time.monotonic() - t0 < 5, "the front did not come back within 5 s"
        time.sleep(0.05)
    print(f"the killed front was back in {time.monotonic() - t0:.2f} s")
    assert cli.json("status", server.host_spec, "--deployment", DEP)["state"] == "healthy"

    # 2. the same with its keeper paused, so the gap lasts while status looks: degraded, exit 1, front named
    rec = json.loads((run / "front.json").read_text())
    os.kill(rec["keeper_pid"], signal.SIGSTOP)
    try:
        os.kill(rec["pid"], signal.SIGKILL)
        time.sleep(0.3)
        r = cli("status", server.host_spec, "--deployment", DEP, "--json")
        assert r.exit_code == 1, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        assert doc["state"] == "degraded" and doc["down"] == ["front"], doc
        assert doc["processes"]["front"] == {"pid": rec["pid"], "alive": False}
        assert doc["processes"]["front_keeper"]["alive"] is True
        r = cli("status", server.host_spec, "--deployment", DEP)
        assert r.exit_code == 1 and f"front (pid {rec['pid']})" in sshd_mod.flat(r.stdout), r.stdout
    finally:
        os.kill(rec["keeper_pid"], signal.SIGCONT)
    t0 = time.monotonic()
    while not _accepts(port):
        assert time.monotonic() - t0 < 5, "the front did not come back within 5 s of its keeper's return"
        time.sleep(0.05)
    assert cli.json("status", server.host_spec, "--deployment", DEP)["state"] == "healthy"


def test_key_rotation_locks_out_the_old_key_with_no_failed_poll(cli, env, two_releases, server, port):
    from tests.deploy_support import HealthPoller

    dep = two_releases["dir"]
    old = (dep / "api_key").read_text().strip()
    r = cli("key", "show", server.host_spec, "--deployment", DEP)
    assert r.exit_code == 0 and r.stdout.strip() == old
    assert _model(port, old)
    with HealthPoller(port) as poll:
        r = cli("key", "rotate", server.host_spec, "--deployment", DEP, "--json")
    assert r.exit_code == 0, r.stderr
    assert poll.failed == 0, poll.failures
    new = cli("key", "show", server.host_spec, "--deployment", DEP).stdout.strip()
    assert new != old and len(new) >= 32
    assert (dep / "api_key").stat().st_mode & 0o777 == 0o600 and not (dep / "api_key.previous").exists()
    for key, want in ((old, 401), (new, 200)):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert conn.getresponse().status == want, key == new
    assert cli.json("status", server.host_spec, "--deployment", DEP)["state"] == "healthy"
