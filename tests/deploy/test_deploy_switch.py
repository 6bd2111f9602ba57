"""Deploy keeps production safe, against a real sshd on 127.0.0.1 and the demo model: a changed release
takes over with no failed /health poll (blue/green behind the front), a release that cannot start gives
up at once with its cause while the old one serves on, a taken --port fails before anything stops,
Ctrl-C during the health wait leaves the old release serving and `current` true, rollback walks back
and goes --to a release, and `stop` signals only the processes it started.

One deployment for the module, the steps building on each other (as on a real host); a client polls the
deployment's port on this machine (the sshd's host is this machine) through every change.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import sshd as sshd_mod
from tests.deploy_support import *  # noqa: F403 - the shared fixtures
from tests.deploy_support import HealthPoller, live_slot, module_env

needs_crontab = pytest.mark.skipif(__import__("shutil").which("crontab") is None,
                                   reason="crontab is missing (apt-get install cron)")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sshd_mod.available() is not None, reason=str(sshd_mod.available()))]

DEP = f"switch-{os.getpid()}"


def _deploy(cli, server, port, model, *extra):
    return cli("deploy", server.host_spec, "--model", model, "--deployment", DEP, "--port", port,
               "--health-timeout", "120", "--json", *extra)


@pytest.fixture(scope="module")
def first(tmp_path_factory, server, port, demo_model, bundle_snapshot, local_home):
    from tests.conftest import Cli

    with module_env(server, tmp_path_factory, bundle_snapshot, local_home) as root:
        r = _deploy(Cli(), server, port, demo_model)
        assert r.exit_code == 0, r.stderr
        yield {"root": root, "dir": root / DEP, "release": json.loads(r.stdout)["release"], "ids": {}}
        Cli()("stop", server.host_spec, "--deployment", DEP)


@pytest.fixture(scope="module")
def bad_tokenizer_model(tmp_path_factory, demo_model):
    """The demo model with a tokenizer.json that is JSON but no tokenizer (a non-JSON one is refused before
    the upload): it splits (the file is copied), and the proxy dies while it starts, every time supervisord
    restarts it."""
    import shutil

    d = tmp_path_factory.mktemp("models") / "bad-tokenizer"
    shutil.copytree(demo_model, d)
    (d / "tokenizer.json").write_text('{"this is": "not a tokenizer"}')
    return d


def _serving(first) -> str:
    return os.readlink(first["dir"] / "current").split("/")[-1]


def test_a_changed_deploy_switches_with_no_failed_poll(cli, env, first, server, port, demo_model):
    old_slot = live_slot(first["dir"])
    old_sup = int((old_slot / "supervisord.pid").read_text())
    with HealthPoller(port) as poll:
        t0 = time.monotonic()
        r = _deploy(cli, server, port, demo_model, "--max-context", "512")
        wall = time.monotonic() - t0
        time.sleep(0.5)
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["kind"] == "deploy_outcome" and doc["schema_version"] == "1.0" and "provenance" in doc
    from v100plan import documents

    documents.validate(doc, "deploy_outcome")
    assert doc["switch"]["mode"] == "blue-green" and doc["previous"] == first["release"]
    assert poll.polls > 50 and poll.failed == 0, (poll.polls, poll.failures)
    print(f"changed deploy: {poll.polls} polls of /health in {wall:.1f} s, {poll.failed} failed")
    assert live_slot(first["dir"]) != old_slot  # the new release runs in the other slot
    assert not Path(f"/proc/{old_sup}").exists() or \
        Path(f"/proc/{old_sup}/stat").read_text().split(") ")[-1][0] == "Z"  # the old release was stopped
    st = cli.json("status", server.host_spec, "--deployment", DEP)
    assert st["state"] == "healthy" and st["release"] == doc["release"] and st["engine"]["max_context"] == 512
    assert st["front"]["port"] == port
    first["ids"]["512"] = doc["release"]


def test_a_release_that_cannot_start_gives_up_at_once_and_the_old_one_serves_on(cli, env, first, server, port,
                                                                                bad_tokenizer_model):
    serving = _serving(first)
    with HealthPoller(port) as poll:
        t0 = time.monotonic()
        r = _deploy(cli, server, port, bad_tokenizer_model)
        gave_up = time.monotonic() - t0
    assert r.exit_code == 1, r.stderr
    err = sshd_mod.flat(r.stderr)
    headline = err.split("Error:", 1)[1][:600]
    assert "failed its checks; release" in headline and "kept serving throughout" in headline, err
    assert "the new release's proxy ended" in headline, err  # its exit ended the wait, not the 120 s timeout
    assert gave_up < 60, gave_up
    assert poll.failed == 0 and poll.polls > 20, (poll.polls, poll.failures)
    import re

    ended = re.search(r"proxy ended ([0-9.]+) s into the health wait", headline)
    print(f"failed deploy gave up in {gave_up:.1f} s (the proxy ended {ended and ended[1]} s into the health wait); "
          f"{poll.polls} polls, {poll.failed} failed")
    assert _serving(first) == serving
    st = cli.json("status", server.host_spec, "--deployment", DEP)
    assert st["state"] == "healthy"
    failed = re.search(r"release ([0-9a-f]{16}) failed its checks", headline)[1]
    assert f"`v100plan logs {server.host_spec} --release {failed}`" in err  # the hint names the command that works
    assert failed not in st["releases"] + st["never_current"]  # discarded: only its logs are left
    r = cli("logs", server.host_spec, "--deployment", DEP, "--release", failed)
    assert r.exit_code == 0, r.stderr
    assert "==> logs/serve.stderr.log <==" in r.stdout and "tokenizer.json" in r.stdout, r.stdout[-2000:]


def test_a_taken_port_fails_before_anything_stops(cli, env, first, server, port, demo_model):
    serving = _serving(first)
    with socket.socket() as taken, HealthPoller(port) as poll:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        t0 = time.monotonic()
        r = _deploy(cli, server, taken.getsockname()[1], demo_model, "--max-context", "512")
        gave_up = time.monotonic() - t0
    assert r.exit_code == 1, r.stderr
    err = sshd_mod.flat(r.stderr)
    assert "Address already in use" in err.split("Error:", 1)[1][:300], err
    assert gave_up < 20, gave_up
    assert poll.failed == 0, poll.failures
    assert _serving(first) == serving


def test_ctrl_c_during_the_health_wait_leaves_the_old_release_serving(cli, env, first, server, port, demo_model):
    from tests.accept_support import PLANTED_ENV, REPO

    serving = _serving(first)
    with HealthPoller(port) as poll:
        proc = subprocess.Popen([sys.executable, "-m", "v100plan", "deploy", server.host_spec, "--model",
                                 str(demo_model), "--deployment", DEP, "--port", str(port), "--max-context", "256"],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env={**os.environ, **PLANTED_ENV})
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if "waiting for /health" in line:
                break
        time.sleep(1.0)  # inside the wait: the new release's processes are starting
        os.killpg(proc.pid, signal.SIGINT)
        _, rest = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(seen)[-2000:] + rest[-2000:]
    assert "interrupted: stopping release" in rest, rest
    assert poll.failed == 0, poll.failures
    assert _serving(first) == serving
    st = cli.json("status", server.host_spec, "--deployment", DEP)
    assert st["state"] == "healthy" and st["release"] == serving and st["lock_holder"] is None
    other = ({"a", "b"} - {st["serving"]["slot"]}).pop()
    pid_file = first["dir"] / "run" / other / "supervisord.pid"
    if pid_file.exists():  # the interrupted release's supervisor is gone
        pid = int(pid_file.read_text())
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] == "Z"


def test_rollback_walks_back_and_goes_to_a_named_release(cli, env, first, server, port, demo_model):
    from v100plan import documents

    r = _deploy(cli, server, port, demo_model, "--max-context", "256")
    assert r.exit_code == 0, r.stderr
    r256, r512, r1 = json.loads(r.stdout)["release"], first["ids"]["512"], first["release"]
    with HealthPoller(port) as poll:
        steps = []
        for extra in ([], [], ["--to", r256[:6]]):
            r = cli("rollback", server.host_spec, "--deployment", DEP, "--json", *extra)
            assert r.exit_code == 0, r.stderr
            steps.append(documents.validate(json.loads(r.stdout), "rollback_outcome")["release"])
        r = cli("rollback", server.host_spec, "--deployment", DEP, "--json")  # after a jump: back where it left
        assert r.exit_code == 0, r.stderr
        steps.append(json.loads(r.stdout)["release"])
    assert steps == [r512, r1, r256, r1]  # back, further back (not toggling), the one named, back from it
    assert poll.failed == 0, poll.failures
    assert _serving(first) == r1
    r = cli("rollback", server.host_spec, "--deployment", DEP, "--to", "zzzz")
    assert r.exit_code == 2 and "names no release" in sshd_mod.flat(r.stderr)


def test_stop_start_names_its_outage(cli, env, first, server, port, demo_model):
    """The fallback for hosts where two releases do not fit (GPUs, `--switch auto`): stop, then start. The
    outage is said, in the dry run's plan and in the output, and the deploy still ends with the new release
    serving."""
    r = _deploy(cli, server, port, demo_model, "--max-context", "128", "--switch", "stop-start", "--dry-run")
    assert r.exit_code == 0, r.stderr
    acts = "\n".join(json.loads(r.stdout)["actions"])
    assert f"stop the service of release {_serving(first)} first (--switch stop-start)" in acts, acts
    assert "if a check fails: stop" in acts and "start " + _serving(first) + " again" in acts, acts
    with HealthPoller(port) as poll:
        r = _deploy(cli, server, port, demo_model, "--max-context", "128", "--switch", "stop-start")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["switch"]["mode"] == "stop-start"
    assert "the service is down until" in sshd_mod.flat(r.stderr)
    assert poll.failed > 0  # what blue/green avoids: the outage is real, and named
    st = cli.json("status", server.host_spec, "--deployment", DEP)
    assert st["state"] == "healthy" and st["engine"]["max_context"] == 128
    r = cli("deploy", server.host_spec, "--demo-model", "--switch", "sideways")
    assert r.exit_code == 2 and "--switch 'sideways'" in sshd_mod.flat(r.stderr)


def test_status_documents_and_a_mistyped_deployment(cli, env, first, server):
    doc = cli.json("status", server.host_spec, "--deployment", DEP)
    assert doc["kind"] == "deployment_status" and doc["schema_version"] == "1.0"
    assert doc["provenance"]["tool"] == "v100plan" and doc["provenance"]["inputs"]["deployment"] == DEP
    from v100plan import documents

    documents.validate(doc, "deployment_status")
    r = cli("status", server.host_spec, "--deployment", DEP + "-typo")
    assert r.exit_code == 2, r.stdout
    assert f"no deployment '{DEP}-typo'" in sshd_mod.flat(r.stderr) and DEP in sshd_mod.flat(r.stderr)


def _kill(pid: int) -> None:
    """SIGKILL one of the service's processes by its recorded PID (a power cut, for this test)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@needs_crontab
def _status_any(cli, server) -> dict:
    """`status --json` of a deployment that may be partly down: exit 0 (running, healthy) or 1 (degraded,
    stopped), the document either way."""
    r = cli("status", server.host_spec, "--deployment", DEP, "--json")
    assert r.exit_code in (0, 1), r.stderr
    return json.loads(r.stdout)


def test_after_a_reboot_the_crontab_entry_brings_the_service_back(cli, env, first, server, port):
    st = cli.json("status", server.host_spec, "--deployment", DEP)
    cron_runs = subprocess.run(["pgrep", "-x", "cron|crond|cronie"], capture_output=True).returncode == 0
    assert st["after_reboot"] == ("cron @reboot" if cron_runs else None)  # a crontab line alone brings nothing back
    run = first["dir"] / "run"
    entry = next(ln for ln in subprocess.run(["crontab", "-l"], capture_output=True, text=True).stdout.splitlines()
                 if ln.endswith(f"# v100plan-boot {run}"))
    assert entry.startswith("@reboot ") and "boot.sh" in entry
    # everything the deployment runs dies at once, by its recorded PIDs
    slot = live_slot(first["dir"])
    svc = json.loads((slot / "service.json").read_text())
    front = json.loads((run / "front.json").read_text())
    pids = [front["keeper_pid"], front["pid"], int((slot / "supervisord.pid").read_text()),
            svc["proxy_pid"], *svc["rank_pids"]]
    for pid in pids:
        _kill(pid)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() and
                                              Path(f"/proc/{p}/stat").read_text().split(") ")[-1][0] != "Z"
                                              for p in pids):
        time.sleep(0.1)
    assert _status_any(cli, server)["state"] != "healthy"
    # what cron does at boot: the entry's command, in cron's bare environment
    subprocess.run(["sh", "-c", entry[len("@reboot "):]], env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
                   timeout=120, check=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        st = _status_any(cli, server)  # "degraded" (exit 1) while its processes come back one by one
        if st["state"] == "healthy":
            break
        time.sleep(1)
    assert st["state"] == "healthy" and st["release"] == _serving(first), st


def test_stop_signals_only_its_own_processes_and_a_second_stop_says_nothing_ran(cli, env, first, server):
    r = cli("stop", server.host_spec, "--deployment", DEP, "--json")
    assert r.exit_code == 0, r.stderr
    from v100plan import documents

    stopped = documents.validate(json.loads(r.stdout), "stop_outcome")["stopped"]
    assert {"supervisord", "proxy", "rank0", "rank1", "front"} <= set(stopped), stopped
    # A stale record: the PIDs in the slot's files now belong to an unrelated process (a PID reused)
    stranger = subprocess.Popen(["sleep", "300"])
    try:
        slot = live_slot(first["dir"])
        (slot / "supervisord.pid").write_text(f"{stranger.pid}\n")
        svc = json.loads((slot / "service.json").read_text())
        svc.update({"proxy_pid": stranger.pid, "rank_pids": [stranger.pid]})
        (slot / "service.json").write_text(json.dumps(svc))  # its start_ticks are the old processes'
        t0 = time.monotonic()
        r = cli("stop", server.host_spec, "--deployment", DEP, "--json")
        took = time.monotonic() - t0
        assert r.exit_code == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["stopped"] == {} and doc["reason"] == "nothing was running", doc
        assert "nothing was running" in sshd_mod.flat(r.stderr)
        assert stranger.poll() is None, "stop signalled a process it did not start"
        assert took < 15, took
    finally:
        stranger.kill()
        stranger.wait()
    assert cli.json("status", server.host_spec, "--deployment", DEP)["state"] == "stopped"
    # stopped stays stopped: the crontab line is gone
    crontab = subprocess.run(["crontab", "-l"], capture_output=True, text=True).stdout
    assert f"# v100plan-boot {first['dir'] / 'run'}" not in crontab


def test_status_of_a_stopped_service_under_a_held_lock_names_the_holder(cli, env, first, server):
    """While a deploy, rollback or stop holds the lock and nothing serves (a stop-start between its stop and
    its start), status says busy and who holds it, not plain "stopped"."""
    from v100plan.remote.connect import Remote, SshOptions
    from v100plan.remote.deploy import held_lock
    from v100plan.remote.host import RemoteSettings
    from v100plan.remote.hosts import parse_host

    assert cli.json("status", server.host_spec, "--deployment", DEP)["state"] == "stopped"  # the test above
    ssh = SshOptions(known_hosts=str(server.known_hosts), identity=str(server.user_key))
    rs = RemoteSettings(root=str(first["root"]), python=sshd_mod.remote_python())
    with Remote(parse_host(server.host_spec), ssh) as other, \
            held_lock(other, rs, str(first["dir"] / "deploy.lock"), "deploy of 0123abcd"):
        st = cli.json("status", server.host_spec, "--deployment", DEP)
    assert st["state"].startswith("busy: deploy of 0123abcd by ") and "@" in st["state"], st["state"]
    assert st["lock_holder"].startswith("deploy of 0123abcd") and "by ?@" not in st["lock_holder"]
    assert cli.json("status", server.host_spec, "--deployment", DEP)["lock_holder"] is None  # gone with its session


def test_an_interrupt_during_the_switch_waits_until_it_is_done():
    """Ctrl-C inside the switch (upstream, `current`, the old release stopped) is held until the block ends,
    then raised: the host is never left half-switched."""
    import signal as sig

    from v100plan.remote.bluegreen import shielded

    done = []
    with pytest.raises(KeyboardInterrupt):
        with shielded():
            os.kill(os.getpid(), sig.SIGINT)
            time.sleep(0.05)
            done.append("upstream")
            os.kill(os.getpid(), sig.SIGTERM)
            done.append("current")
    assert done == ["upstream", "current"]
    assert sig.getsignal(sig.SIGINT) is sig.default_int_handler  # the handlers are put back
