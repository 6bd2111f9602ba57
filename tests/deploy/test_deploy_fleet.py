"""Deploy, status and stop over an inventory: three hosts, one of them down. The two that answer are deployed
in parallel, the third is named in the summary table and on stderr, and the exit code says it failed.

Each host is a real sshd on this machine in network and mount namespaces of its own (tests/sshd.py,
start_apart: its own 127.0.0.1, so both run the service on the same --port; its own deployment folder at the
same path), reached by an ~/.ssh/config alias whose ProxyCommand relays into its namespace. The namespaces
have no network, so the remote root's venvs and model store are made first by a deploy to the suite's own
sshd (another deployment, stopped), and the hosts share them. Root only: the namespaces need it, and the
test is skipped otherwise, saying so.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests import sshd as sshd_mod
from tests.deploy_support import *  # noqa: F403 - the shared fixtures

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sshd_mod.available() is not None, reason=str(sshd_mod.available())),
              pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter")),
                                 reason="needs root, unshare and nsenter: each host runs in namespaces of its own")]

DEP = f"fleet-{os.getpid()}"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, server, port, demo_model, bundle_snapshot, local_home):
    from tests.conftest import Cli
    from tests.deploy_support import module_env

    base = tmp_path_factory.mktemp("fleet")
    root_at = base / "remote-root"  # the remote root on every host: venvs, bundles and models shared
    with module_env(server, tmp_path_factory, bundle_snapshot, local_home):
        os.environ["V100PLAN_REMOTE_ROOT"] = str(root_at)
        try:
            for args in (["deploy", server.host_spec, "--model", demo_model, "--port", port],
                         ["stop", server.host_spec]):
                r = Cli()(*args, "--deployment", f"{DEP}-warm")
                assert r.exit_code == 0, r.stderr
        finally:
            del os.environ["V100PLAN_REMOTE_ROOT"]
    (root_at / DEP).mkdir()  # each host mounts its own deployment folder here
    known = base / "known_hosts"
    lines, config, hosts = [], [], []
    for name in ("fleet-a", "fleet-b"):
        s = sshd_mod.make_sshd(base / name, user_key=server.user_key)
        own = base / f"{name}-root"
        own.mkdir()
        proxy = sshd_mod.start_apart(s, root_at / DEP, own)
        hosts.append((name, s, own))
        lines.append(s.known_hosts_line())
        config.append(f"Host {name}\n  HostName 127.0.0.1\n  Port {s.port}\n  User {s.user}\n  ProxyCommand {proxy}\n")
    config.append(f"Host fleet-c\n  HostName 127.0.0.1\n  Port {sshd_mod.free_port()}\n  User root\n")  # down
    known.write_text("".join(lines))
    home = base / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    (home / ".ssh" / "config").write_text("".join(config))
    inventory = base / "hosts.txt"
    inventory.write_text("# three hosts, the last one down\nfleet-a\nfleet-b\nfleet-c\n")
    yield {"inventory": inventory, "known": known, "home": home, "root_at": root_at, "hosts": hosts}
    for _, s, _ in hosts:
        s.stop()


def test_an_inventory_deploy_to_three_hosts_with_one_down_deploys_two_and_names_the_third(
        cli, env, fleet, monkeypatch, port, demo_model):
    monkeypatch.setenv("HOME", str(fleet["home"]))
    monkeypatch.setenv("V100PLAN_KNOWN_HOSTS", str(fleet["known"]))
    monkeypatch.setenv("V100PLAN_REMOTE_ROOT", str(fleet["root_at"]))
    inv = str(fleet["inventory"])
    try:
        r = cli("deploy", "--inventory", inv, "--model", demo_model, "--deployment", DEP, "--port", port,
                "--health-timeout", "150", "--connect-timeout", "3", "--json")
        assert r.exit_code == 4, r.stdout + r.stderr  # the down host's: unreachable
        from v100plan import documents

        doc = documents.validate(json.loads(r.stdout), "fleet_outcome")
        assert doc["kind"] == "fleet_outcome" and doc["action"] == "deploy" and doc["failed"] == ["fleet-c"], doc["failed"]
        by = {h["host"]: h for h in doc["hosts"]}
        assert [h["host"] for h in doc["hosts"]] == ["fleet-a", "fleet-b", "fleet-c"]
        for name in ("fleet-a", "fleet-b"):
            assert by[name]["ok"] and by[name]["result"]["changed"] is True, by[name]
        assert by["fleet-a"]["result"]["release"] == by["fleet-b"]["result"]["release"]
        assert "cannot open an SSH session" in by["fleet-c"]["error"]
        err = sshd_mod.flat(r.stderr)
        assert "1 of 3 host(s) failed: fleet-c (" in err, err
        for _, _, own in fleet["hosts"]:  # each host's own deployment folder
            assert (own / "current").is_symlink()

        r = cli("status", "--inventory", inv, "--deployment", DEP, "--connect-timeout", "3", "--json")
        assert r.exit_code == 4, r.stdout + r.stderr
        states = {h["host"]: (h["result"] or {}).get("state") for h in json.loads(r.stdout)["hosts"]}
        assert states == {"fleet-a": "healthy", "fleet-b": "healthy", "fleet-c": None}, states
        r = cli("status", "--inventory", inv, "--deployment", DEP, "--connect-timeout", "3")
        assert r.exit_code == 4 and "failed (exit 4)" in r.stdout and "healthy" in r.stdout, r.stdout
    finally:
        r = cli("stop", "--inventory", inv, "--deployment", DEP, "--connect-timeout", "3", "--json")
    doc = json.loads(r.stdout)
    assert [h["host"] for h in doc["hosts"] if h["ok"]] == ["fleet-a", "fleet-b"], doc
    assert all("front" in h["result"]["stopped"] for h in doc["hosts"] if h["ok"])


def test_host_and_inventory_together_is_bad_input(cli, fleet):
    r = cli("status", "somehost", "--inventory", str(fleet["inventory"]))
    assert r.exit_code == 2 and "exactly one of HOST and --inventory" in sshd_mod.flat(r.stderr)
    r = cli("status")
    assert r.exit_code == 2
