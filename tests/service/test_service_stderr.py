"""Issue 46: logging never dies with its stderr. serve's stderr is a pipe whose reader is gone before the
service is even up (a supervisor or a shell pipeline that went away): /health still turns 200, requests
are served, SIGTERM is handled at once, and the structured log file has every line, the break included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.test_service_support import ServiceProcess

pytestmark = pytest.mark.slow


def test_a_closed_stderr_leaves_health_200_sigterm_handled_and_the_log_file_complete():
    svc = ServiceProcess(stderr=subprocess.PIPE)
    svc.proc.stderr.close()  # the reader is gone: every write to serve's stderr now fails (EPIPE)
    try:
        svc.wait_healthy(timeout_s=120)
        r = svc.complete([1, 2, 3], 4)
        assert r.status_code == 200, r.text
        svc.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert svc.proc.wait(30) == 0
        took = time.monotonic() - t0
        assert took < 15, took  # the first SIGTERM drains and exits; it is not lost in a dead log task
        lines = [json.loads(line) for line in open(os.path.join(svc.state_dir, "service.log"))]
        events = [e["event"] for e in lines]
        for want in ("serve_start", "ranks_up", "stderr_lost", "request", "signal", "drained", "serve_stop",
                     "serve_exit"):
            assert want in events, (want, events)
        assert [e["seq"] for e in lines] == sorted(e["seq"] for e in lines)
        assert next(e for e in lines if e["event"] == "stderr_lost")["reason"].startswith("BrokenPipeError")
        assert lines[-1]["event"] == "serve_exit" and lines[-1]["code"] == 0
        assert next(e for e in lines if e["event"] == "request")["status"] == 200
    finally:
        svc.stop()
