"""One case runner for the probes and the acceptance suite: every way a case goes wrong (applicable()
raising included) is that case's "error", the next case still runs, and a waived case is never passed."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from probes import case_runner
from probes import cases as probe_cases
from v100plan.accept import cases as accept_cases
from v100plan.accept import runner as accept_runner
from v100plan.accept.context import AcceptOptions, Target


def _raise(_ctx):
    raise RuntimeError("nvml lost the card")


def _probe_case(key, run, applicable=None, timeout=5.0):
    return probe_cases.Case(key, f"{key} case", applicable or (lambda _c: None), run, lambda _c: timeout, 0)


def _accept_case(key, run, applicable=None, timeout=5.0):
    return accept_cases.Case(key, f"{key} case", "functional", run, applicable or (lambda _c: None),
                             lambda _c: timeout)


@pytest.mark.parametrize("make, ok", [(_probe_case, lambda: probe_cases.Outcome("passed")),
                                      (_accept_case, accept_cases.Outcome)])
def test_both_kinds_of_case_are_contained_alike(make, ok):
    ran = {c.key: case_runner.run_case(c, None) for c in [
        make("applicable_raises", lambda _c: ok(), applicable=_raise),
        make("raises", _raise),
        make("hangs", lambda _c: time.sleep(30), timeout=0.3),
        make("bad_return", lambda _c: "ok"),
        make("waived", lambda _c: ok(), applicable=lambda _c: "one card"),
        make("passes", lambda _c: ok()),
    ]}
    assert ran["applicable_raises"].status == "error"
    assert "applicability check raised RuntimeError: nvml lost the card" in ran["applicable_raises"].reason
    assert ran["raises"].status == "error" and "nvml lost the card" in ran["raises"].reason
    assert ran["hangs"].status == "error" and "timeout" in ran["hangs"].reason
    assert ran["bad_return"].status == "error" and "instead of an outcome" in ran["bad_return"].reason
    assert (ran["waived"].status, ran["waived"].reason) == ("waived", "one card")
    assert ran["passes"].status == "passed" and ran["passes"].outcome is not None
    assert set(r.status for r in ran.values()) <= set(case_runner.STATUSES)


class _Models(BaseHTTPRequestHandler):
    """The least an OpenAI-compatible server answers: one model; everything else 404."""

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/v1/models":
            self._send(200, {"data": [{"id": "tiny", "object": "model"}]})
        else:
            self._send(404, {"error": {"message": "not here"}})

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self._send(400, {"error": {"message": "no completions here"}})

    def log_message(self, *_a):
        pass


def test_an_acceptance_case_whose_applicability_check_raises_is_an_error_and_the_suite_goes_on(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(accept_runner, "registry", lambda: [
            _accept_case("broken_check", lambda _c: accept_cases.Outcome(), applicable=_raise),
            _accept_case("after_it", lambda _c: accept_cases.Outcome())])
        target = Target(endpoint=f"http://127.0.0.1:{server.server_address[1]}")
        result = accept_runner.run_acceptance(target, AcceptOptions(requests=0))
    finally:
        server.shutdown()
    by_key = {s["key"]: s for s in result["scenarios"]}
    assert by_key["broken_check"]["status"] == "error"
    assert "nvml lost the card" in by_key["broken_check"]["reason"]
    assert by_key["after_it"]["status"] == "passed"
    assert accept_runner.verdict(result["scenarios"], None)[0] == "failed"

