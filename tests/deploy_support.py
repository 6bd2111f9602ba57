"""Fixtures and helpers the deploy tests share (tests/deploy/): a real sshd on 127.0.0.1 per
module, the demo model made once per module, a frozen copy of the bundle's sources, the module's local
v100plan home (where the split is cached), and a poller that counts failed /health answers.

A test module takes them with ``from tests.deploy_support import *`` (pytest finds imported fixtures).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import sshd as sshd_mod

__all__ = ["server", "port", "demo_model", "local_home", "env", "bundle_snapshot", "tree", "HealthPoller",
           "live_slot", "module_env", "other_user", "shared_tmp"]

OTHER_USER = "v100plan-other"  # the second local user of the trust tests (made with useradd when root)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = sshd_mod.make_sshd(tmp_path_factory.mktemp("sshd-deploy")).start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def other_user():
    """(name, uid, gid) of a second, unprivileged local user: made with useradd (no home, no login) when the
    tests run as root, else the test is skipped, saying why."""
    import pwd

    if os.geteuid() != 0:
        pytest.skip("needs root to add a second local user with useradd (the tests run unprivileged)")
    try:
        pw = pwd.getpwnam(OTHER_USER)
    except KeyError:
        if shutil.which("useradd") is None:
            pytest.skip("useradd is missing: no second local user can be made")
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
                       check=True, capture_output=True, timeout=60)
        pw = pwd.getpwnam(OTHER_USER)
    return pw.pw_name, pw.pw_uid, pw.pw_gid


@pytest.fixture
def shared_tmp():
    """A folder every local user may write into, as /tmp is (mode 1777), directly under /tmp so another
    user can reach it (pytest's own temp folders are 0700); removed afterwards."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="v100plan-shared-", dir="/tmp"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def port():
    return sshd_mod.free_port()


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory, request):
    """The demo model, with a README naming this module and run: the same weights everywhere, yet a model
    of the module's own (its shards' digest differs), so the host's model store shared by every
    deployment under the remote root does not make one module's first upload depend on another's."""
    d = tmp_path_factory.mktemp("models") / "demo"
    subprocess.run([sys.executable, "-m", "engine", "make-demo-model", str(d)], check=True, capture_output=True,
                   timeout=300)
    (d / "README.md").write_text(f"the demo model of {request.module.__name__}, run {os.getpid()}\n")
    return d


@pytest.fixture(scope="module")
def local_home(tmp_path_factory):
    """The module's local v100plan home: where the split shards are cached."""
    return tmp_path_factory.mktemp("v100plan-home-deploy")


@pytest.fixture(scope="module")
def bundle_snapshot(tmp_path_factory):
    """probes/, engine/ and profiles/ as they are now: edits made to the working tree while this module
    runs must not turn "nothing changed" into a new release."""
    from v100plan.remote.bundle import PACKAGES, source_root

    snap = tmp_path_factory.mktemp("bundle-src")
    for pkg in PACKAGES:
        shutil.copytree(source_root() / pkg, snap / pkg, ignore=shutil.ignore_patterns("__pycache__", ".*"))
    return snap


def point_at(mp: pytest.MonkeyPatch, server, tmp_path_factory, bundle_snapshot, local_home) -> Path:  # noqa: ANN001
    """Every remote command at this sshd and the session's remote root, the bundle at its snapshot, the
    local home at the module's; returns the remote root."""
    root = sshd_mod.shared_remote_root(tmp_path_factory)
    sshd_mod.remote_env(mp, server, root)
    mp.setenv("V100PLAN_BUNDLE_ROOT", str(bundle_snapshot))
    mp.setenv("V100PLAN_HOME", str(local_home))
    return root


@contextlib.contextmanager
def module_env(server, tmp_path_factory, bundle_snapshot, local_home) -> Iterator[Path]:  # noqa: ANN001
    """``point_at`` for a module-scoped fixture (its own MonkeyPatch, undone when the block ends)."""
    mp = pytest.MonkeyPatch()
    try:
        yield point_at(mp, server, tmp_path_factory, bundle_snapshot, local_home)
    finally:
        mp.undo()


@pytest.fixture
def env(monkeypatch, server, tmp_path_factory, bundle_snapshot, local_home):
    return point_at(monkeypatch, server, tmp_path_factory, bundle_snapshot, local_home)


def tree(root: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple]:
    """Every path under ``root`` with its type, size, mode, mtime and link target."""
    out = {}
    for base, dirs, files in os.walk(root):
        rel_base = os.path.relpath(base, root)
        if any(rel_base == s or rel_base.startswith(s + "/") for s in skip):
            dirs[:] = []
            continue
        for name in dirs + files:
            p = os.path.join(base, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_size if not os.path.isdir(p) else 0,
                                             st.st_mtime_ns, os.readlink(p) if os.path.islink(p) else None)
    return out


def live_slot(dep_dir: Path) -> Path:
    """The state dir of the release the deployment's front serves (run/a or run/b)."""
    import json

    return dep_dir / "run" / json.loads((dep_dir / "run" / "upstream.json").read_text())["slot"]


class HealthPoller:
    """GET http://127.0.0.1:PORT/health every ``every_s`` on a thread, as a client of the service would
    (the sshd is this machine, so the host's loopback port is reachable from the test): counts the
    polls and the failed ones (refused, reset, or not 200), with the first few failures kept."""

    def __init__(self, port: int, every_s: float = 0.02):
        self.url = f"http://127.0.0.1:{port}/health"
        self.every_s = every_s
        self.polls = 0
        self.failed = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.polls += 1
            try:
                with urllib.request.urlopen(self.url, timeout=10) as resp:
                    ok = resp.status == 200
                    why = f"status {resp.status}"
            except urllib.error.HTTPError as e:
                ok, why = False, f"status {e.code}"
            except OSError as e:
                ok, why = False, str(e)
            if not ok:
                self.failed += 1
                if len(self.failures) < 5:
                    self.failures.append(f"{time.strftime('%H:%M:%S')} {why}")
            time.sleep(self.every_s)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(15)
