"""Child processes a test only waits on, started early and in the background.

Some tests run one long CPU-bound child and then check what it printed: the kernel cases under Triton's
interpreter (tests/engine_*_cases.py) and the sm_70 compile (engine/core/sm70.py), some five minutes of one
core together. Such a test takes ``@pytest.mark.early(spec)``; when collection has picked the tests that
will run, tests/conftest.py hands their specs to ``start`` and two background threads run them, in that order,
at the lowest CPU priority (nice 19, also for the child's own session's autogroup), so they use the
cores the rest of the run leaves idle (most tests wait on services and subprocesses) and yield the CPU to
everything else. The test itself calls ``run(spec)``: it gets the child's result as ``subprocess.run``
would have given it, waiting if the child is still running and running it then and there, at normal
priority, if it has not started yet (or has no marker).

What a child checks does not depend on when it runs: the children started here measure no time and talk to
no other test. The one wall-clock limit among them is tests/engine_exchange_cases.py's barrier of 600 s for
its two rank processes (their spin-waits count spins, not time): at nice 19 a child still gets about 1.5% of
a busy core, and a rank needs a few CPU seconds (spawn, import torch) to reach the barrier.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Run before the child's module (python -c): the lowest priority for the child and everything it starts.
# With autogroup scheduling (a root cpu cgroup) a nice value only counts inside the session's autogroup,
# so the child gets a session of its own (start_new_session) and that autogroup is niced too.
_LOW_PRIORITY = """import os, runpy, sys
try:
    with open("/proc/self/autogroup", "w") as fh:
        fh.write("19")
except OSError:
    pass
os.nice(19)
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@dataclasses.dataclass(frozen=True)
class Spec:
    """``python -m MODULE ARGS...`` in the repository root, the environment of the run with ``set_env``
    added and ``drop_env`` taken out; ``timeout_s`` counts from when the test starts waiting."""

    module: str
    args: tuple[str, ...] = ()
    set_env: tuple[tuple[str, str], ...] = ()
    drop_env: tuple[str, ...] = ()
    timeout_s: float = 900

    def env(self, base: dict[str, str]) -> dict[str, str]:
        env = {**base, **dict(self.set_env)}
        for k in self.drop_env:
            env.pop(k, None)
        return env


@dataclasses.dataclass
class _Job:
    spec: Spec
    state: str = "queued"  # queued -> running -> done; or claimed (the test runs it itself)
    proc: subprocess.Popen | None = None
    result: subprocess.CompletedProcess | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


WORKERS = 2  # children at a time: the CI host has two cores, and at nice 19 they take only what is idle
_lock = threading.Lock()
_jobs: dict[Spec, _Job] = {}
_stopping = threading.Event()
_home: str | None = None


def start(specs: list[Spec]) -> None:
    """Queue the specs (each once) and start the background thread that runs them in this order."""
    global _home
    with _lock:
        new = [s for s in dict.fromkeys(specs) if s not in _jobs]
        if not new:
            return
        for s in new:
            _jobs[s] = _Job(s)
        if _home is None:  # a v100plan home of their own, as each test gets one (tests/conftest.py)
            _home = tempfile.mkdtemp(prefix="v100plan-early-")
    for i in range(min(WORKERS, len(new))):
        threading.Thread(target=_worker, args=(new,), name=f"early-children-{i}", daemon=True).start()


def _worker(specs: list[Spec]) -> None:
    for s in specs:
        with _lock:
            job = _jobs[s]
            if _stopping.is_set() or job.state != "queued":
                continue  # another worker's, or claimed by its test
            env = s.env({**os.environ, "V100PLAN_HOME": _home or ""})
            job.proc = subprocess.Popen([sys.executable, "-c", _LOW_PRIORITY, s.module, *s.args], cwd=REPO, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        start_new_session=True)
            job.state = "running"
        out, err = job.proc.communicate()
        job.result = subprocess.CompletedProcess(job.proc.args, job.proc.returncode, out, err)
        job.state = "done"
        job.done.set()


def run(spec: Spec) -> subprocess.CompletedProcess:
    """The child's result: the early one's (waited for), else the child run now, as subprocess.run does."""
    with _lock:
        job = _jobs.get(spec)
        if job is None or job.state == "queued":
            if job is not None:
                job.state = "claimed"
            job = None
    if job is None:
        return subprocess.run([sys.executable, "-m", spec.module, *spec.args], cwd=REPO, env=spec.env(dict(os.environ)),
                              capture_output=True, text=True, timeout=spec.timeout_s)
    if not job.done.wait(spec.timeout_s):
        _kill(job)
        raise subprocess.TimeoutExpired(job.proc.args if job.proc else spec.module, spec.timeout_s)
    assert job.result is not None
    return job.result


def _kill(job: _Job) -> None:
    p = job.proc
    if p is not None and p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # our own child's session (start_new_session): it and what it started
        except OSError:
            pass


def stop() -> None:
    """End of the session: start nothing more, stop what still runs, remove the children's home."""
    global _home
    _stopping.set()
    with _lock:
        jobs = list(_jobs.values())
    for job in jobs:
        _kill(job)
        if job.proc is not None:
            try:
                job.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
    if _home is not None:
        shutil.rmtree(_home, ignore_errors=True)
        _home = None
