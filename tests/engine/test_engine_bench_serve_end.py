"""engine.bench.served.end_serve: the service benches' one ending (stop, log tail, temporary checkpoint gone)."""

import signal
import subprocess
import sys
import time

import pytest

from engine.bench.served import end_serve

# A stand-in for `python -m engine serve`: writes 30 numbered log lines, then waits for SIGTERM (or ignores it).
SERVE = ("import signal, sys, time\n"
         "if sys.argv[1] == 'stubborn':\n"
         "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         "for i in range(30):\n"
         "    print(f'line {i}', flush=True)\n"
         "print('ready', flush=True)\n"
         "time.sleep(600)\n")


def _serving(work, mode="polite"):
    (work / "model").mkdir(parents=True)
    log = open(work / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-c", SERVE, mode], stdout=log, stderr=subprocess.STDOUT)
    for _ in range(200):
        if b"ready" in (work / "serve.log").read_bytes():
            break
        time.sleep(0.05)
    return proc, log


@pytest.mark.parametrize("remove", [True, False])
def test_the_service_stops_its_log_tail_is_kept_and_a_temporary_work_dir_goes(tmp_path, remove):
    work = tmp_path / "work"
    proc, log = _serving(work)
    doc, emitted = {}, []
    end_serve(proc, log, work, doc, lambda: emitted.append(dict(doc)), remove=remove)
    assert proc.returncode == -signal.SIGTERM
    assert log.closed
    assert doc["log_tail"] == [f"line {i}" for i in range(11, 30)] + ["ready"]
    assert emitted == [doc]
    assert work.exists() is not remove


def test_a_service_that_ignores_sigterm_is_killed_past_the_limit(tmp_path, monkeypatch):
    import engine.bench.served as served

    waited = []
    real = served.stop_serve
    monkeypatch.setattr(served, "stop_serve", lambda proc, timeout_s: (waited.append(timeout_s), real(proc, 0.5)))
    work = tmp_path / "work"
    proc, log = _serving(work, "stubborn")
    doc = {}
    end_serve(proc, log, work, doc, lambda: None, remove=True)
    assert waited == [60]
    assert proc.returncode == -signal.SIGKILL
    assert not work.exists()
