"""Issue 46, the service's own safety: every command that acts on a state directory (serve, supervise
start / status / stop) refuses one that another local user could have prepared, the folders above it
included, and a process is signalled only when it proves it is ours (the state directory's secret in
its environment, which /proc/PID/environ shows to its owner and root alone), not by a start time
anyone can read. Real processes, a real second local user (made with useradd when running as root)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import uuid

import pytest

from tests.test_service_support import REPO, ServiceProcess, demo_model, pid_alive, wait_until

INTRUDER = "v1p-intruder"


@pytest.fixture(scope="module")
def intruder():
    """A second, unprivileged local user (uid, gid): made with useradd for the module, removed after."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test makes a second local user (useradd) and files owned by it")
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed: no second local user can be made")
    made = False
    try:
        pw = pwd.getpwnam(INTRUDER)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", INTRUDER], check=True,
                       capture_output=True)
        pw, made = pwd.getpwnam(INTRUDER), True
    yield pw.pw_uid, pw.pw_gid
    if made:
        subprocess.run(["userdel", INTRUDER], capture_output=True)


@pytest.fixture
def base():
    """A folder under /tmp the intruder may enter (0711, root's)."""
    path = tempfile.mkdtemp(prefix="v1p-id-")
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _as(uid_gid, *cmd: str) -> None:
    """Run `cmd` as the intruder (a real process of theirs: what they make is theirs)."""
    uid, gid = uid_gid
    subprocess.run(cmd, check=True, user=uid, group=gid, extra_groups=[], capture_output=True, timeout=30)


def _engine(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def _victim() -> subprocess.Popen:
    """A process of this user (root in CI) that nobody asked `supervise` to stop."""
    return subprocess.Popen(["sleep", "120"])


def _forged(victim: subprocess.Popen) -> str:
    """What another user can write: service.json naming the victim, with its start time (anyone reads
    /proc/PID/stat) and an identity of their own."""
    from engine.service.state_dir import start_time

    v = victim.pid
    return json.dumps({"proxy_pid": v, "rank_pids": [v, v], "start_times": {str(v): start_time(v)}})


def test_a_forged_service_json_in_another_users_folder_or_a_link_to_it_signals_nothing(intruder, base):
    home = os.path.join(base, "home")
    os.mkdir(home, 0o755)
    os.chown(home, *intruder)
    evil = os.path.join(home, "state")
    victim = _victim()
    try:
        _as(intruder, "mkdir", "-m", "700", evil)
        _as(intruder, "sh", "-c", 'printf %s "$1" > "$2/service.json"; printf %032d 0 > "$2/identity"', "sh",
            _forged(victim), evil)
        link_in_theirs = os.path.join(home, "link")
        _as(intruder, "ln", "-s", evil, link_in_theirs)
        link_in_mine = os.path.join(base, "link")
        os.symlink(evil, link_in_mine)
        for state, says in ((evil, f"belongs to uid {intruder[0]}"), (link_in_theirs, f"belongs to uid {intruder[0]}"),
                            (link_in_mine, "is a symbolic link")):
            for action in ("stop", "status"):
                r = _engine("supervise", action, "--state-dir", state)
                assert r.returncode == 2, (action, state, r.returncode, r.stdout, r.stderr)
                assert says in r.stderr and r.stderr.startswith("Error: ") and "Traceback" not in r.stderr, r.stderr
                assert r.stdout == ""
            assert victim.poll() is None, f"`supervise stop --state-dir {state}` signalled the victim"
        r = _engine("supervise", "start", "--state-dir", link_in_mine, "--", "--model", demo_model())
        assert r.returncode == 1 and "is a symbolic link" in r.stderr, r.stderr
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_a_state_dir_below_another_users_folder_is_refused_by_every_command(intruder, base):
    parent = os.path.join(base, "p")
    os.mkdir(parent, 0o755)
    state = os.path.join(parent, "state")
    os.mkdir(state, 0o700)  # this user's own state directory, but in the intruder's folder: they could swap it
    os.chown(parent, *intruder)
    says = f"{parent}, above the state directory {state}, belongs to uid {intruder[0]}"
    r = _engine("serve", "--model", demo_model(), "--port", "9", "--state-dir", state, timeout=60)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert os.listdir(state) == []  # nothing written there: no log, no lock, no identity
    for action in ("start", "stop", "status"):
        extra = ("--", "--model", demo_model()) if action == "start" else ()
        r = _engine("supervise", action, "--state-dir", state, *extra)
        assert r.returncode != 0 and says in r.stderr, (action, r.stderr)
    # a folder others may write (not sticky) above it is refused the same way
    os.chown(parent, 0, 0)
    os.chmod(parent, 0o777)
    r = _engine("supervise", "stop", "--state-dir", state)
    assert r.returncode == 2 and "is writable by other users (mode 0777)" in r.stderr, r.stderr
    os.chmod(parent, 0o755)
    r = _engine("supervise", "stop", "--state-dir", state)
    assert r.returncode == 0, r.stderr


def test_a_start_time_is_no_proof_the_environment_secret_is(tmp_path):
    """In this user's own state directory: service.json names a process of this user with its right start
    time (what anyone can read), but the process does not carry the state directory's secret: left alone."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    victim = _victim()
    try:
        (state / "service.json").write_text(_forged(victim))
        r = _engine("supervise", "stop", "--state-dir", str(state))
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["had_to_kill"] == [] and set(out["not_ours"]) == {"proxy", "rank0", "rank1"}, out
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_every_process_of_a_service_carries_its_secret_and_stop_ends_them(tmp_path):
    """serve started by hand (no secret in its environment) executes itself once with it: the proxy, the
    fork server and both forked ranks carry it, and `supervise stop` proves and ends each."""
    from engine.service.state_dir import carries_id, service_id

    svc = ServiceProcess()
    try:
        health = svc.wait_healthy()
        token = service_id(svc.state_dir, create=False)
        assert token is not None and oct(os.stat(os.path.join(svc.state_dir, "identity")).st_mode & 0o777) == "0o600"
        doc = json.loads(open(os.path.join(svc.state_dir, "service.json")).read())
        assert doc["proxy_pid"] == svc.proc.pid  # the same PID after the self-exec
        pids = [svc.proc.pid, *health["rank_pids"]]
        assert all(carries_id(p, token) for p in pids), pids
        assert not carries_id(svc.proc.pid, uuid.uuid4().hex)
        r = _engine("supervise", "stop", "--state-dir", svc.state_dir)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        # all three proven ours; no supervisord here, so stop SIGKILLs them (a rank may go first with its peer)
        assert set(out["stopped"]) == {"proxy", "rank0", "rank1"} and out["not_ours"] == [], out
        assert "proxy" in out["had_to_kill"] and out["left_running"] == [], out
        for p in pids:
            wait_until(lambda p=p: not pid_alive(p), 10, what=f"pid {p} to end")
    finally:
        svc.stop()
