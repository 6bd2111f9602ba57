"""The host's model store and what brings a deployment back after a reboot, against a real sshd on
127.0.0.1: a second deployment of the same model uploads nothing for it (the store entry is checked by
SHA-256, not trusted by name), a broken upload never becomes an entry, `remove` drops an entry only
once no release links it; the uploaded bytes are counted by part (bundle, model); the reboot mechanism
(a systemd user unit, else the crontab @reboot line) is chosen, reported and taken out again.

Three deployments of the module share one remote root (the session's), as deployments on one host do.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests import sshd as sshd_mod
from tests.deploy_support import *  # noqa: F403 - the shared fixtures
from tests.deploy_support import module_env

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sshd_mod.available() is not None, reason=str(sshd_mod.available()))]

A, B, C = (f"store-{x}-{os.getpid()}" for x in "abc")


@pytest.fixture(scope="module")
def bundle_snapshot(tmp_path_factory):  # noqa: F811 - this module's own: a bundle no other module sent
    """The bundle's sources with one file of this run's added: a bundle the host does not hold yet, so the
    first deploy sends it (and its bytes are counted as the bundle's)."""
    from v100plan.remote.bundle import PACKAGES, source_root

    snap = tmp_path_factory.mktemp("bundle-src-store")
    for pkg in PACKAGES:
        shutil.copytree(source_root() / pkg, snap / pkg, ignore=shutil.ignore_patterns("__pycache__", ".*"))
    (snap / "profiles" / f"store-test-{os.getpid()}.txt").write_text("this run's bundle\n")
    return snap


@pytest.fixture(scope="module")
def other_model(tmp_path_factory, demo_model):
    """Another model (same weights, another README: other shards' digest), for the broken upload."""
    d = tmp_path_factory.mktemp("models") / "other"
    shutil.copytree(demo_model, d)
    (d / "README.md").write_text(f"another model, run {os.getpid()}\n")
    return d


def _deploy(cli, server, dep, model, port, *extra):
    return cli("deploy", server.host_spec, "--model", model, "--deployment", dep, "--port", port,
               "--health-timeout", "120", *extra)


def _entry_of(root: Path, dep: str) -> Path:
    return (root / dep / "current" / "model").resolve()


def _marked(run: Path) -> list[str]:
    out = subprocess.run(["crontab", "-l"], capture_output=True, text=True).stdout.splitlines()
    return [ln for ln in out if ln.endswith(f"# v100plan-boot {run}")]


@pytest.fixture(scope="module")
def two(tmp_path_factory, server, demo_model, bundle_snapshot, local_home):
    """Deployment A of the demo model, then B of the same model on another port (the CLI's JSON of each)."""
    from tests.conftest import Cli

    with module_env(server, tmp_path_factory, bundle_snapshot, local_home) as root:
        ports = {A: sshd_mod.free_port(), B: sshd_mod.free_port(), C: sshd_mod.free_port()}
        ra = _deploy(Cli(), server, A, demo_model, ports[A], "--json")
        rb = _deploy(Cli(), server, B, demo_model, ports[B], "--json")
        yield {"root": root, "ports": ports, "a": ra, "b": rb}
        for dep in (A, B, C):
            Cli()("remove", server.host_spec, "--deployment", dep, "--yes")


def test_a_second_deployment_of_the_same_model_uploads_nothing_for_it(cli, env, two, server, demo_model):
    from v100plan import documents
    from v100plan.remote.bundle import build

    assert two["a"].exit_code == 0, two["a"].stderr
    assert two["b"].exit_code == 0, two["b"].stderr
    a, b = json.loads(two["a"].stdout), json.loads(two["b"].stdout)
    for doc in (a, b):
        documents.validate(doc, "deploy_outcome")
    # A sent this run's bundle and the model's shards, counted apart; together they are all it sent
    assert a["uploaded"]["bundle_bytes"] == build().size > 0
    assert a["uploaded"]["model_bytes"] > 13_000_000
    assert a["uploaded_bytes"] == a["uploaded"]["bundle_bytes"] + a["uploaded"]["model_bytes"]
    # B: another deployment, another release, the same shard files: nothing uploaded at all
    assert b["release"] != a["release"]
    assert b["uploaded"] == {"bundle_bytes": 0, "model_bytes": 0} and b["uploaded_bytes"] == 0
    err = sshd_mod.flat(two["b"].stderr)
    assert "reusing model" in err and "SHA-256 checked" in err, err
    print(f"deployment A: {a['uploaded']} in {a['wall_s']:.1f} s; deployment B of the same model: {b['uploaded']} "
          f"in {b['wall_s']:.1f} s")
    root = two["root"]
    entry = _entry_of(root, A)
    assert entry == _entry_of(root, B) and entry.parent == root / "models"
    assert entry.name == json.loads((root / A / "current" / "manifest.json").read_text())["model"]["digest"]
    assert (entry / ".v100plan-verified").is_file() and not (root / A / "models").exists()
    assert not list((root / "models" / ".partial").glob(f"{entry.name}-*"))  # the upload was renamed into place
    for dep in (A, B):
        assert cli.json("status", server.host_spec, "--deployment", dep)["state"] == "healthy"
    # the table names the parts too (a redeploy with nothing changed: nothing sent)
    r = _deploy(cli, server, A, demo_model, two["ports"][A])
    assert r.exit_code == 0, r.stderr
    assert "uploaded bytes" in r.stdout and "0 (bundle 0, model 0)" in r.stdout, r.stdout


def test_a_store_entry_is_checked_by_its_checksums_not_trusted_by_its_name(cli, env, two, server, demo_model):
    """One byte of a stored shard flipped (a bad disk): the next release that links the entry finds it by
    SHA-256 and sends that one file anew; both deployments keep serving."""
    entry = _entry_of(two["root"], A)
    victim = entry / "rank0" / "model.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    r = _deploy(cli, server, B, demo_model, two["ports"][B], "--max-context", "512", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    err = sshd_mod.flat(r.stderr)
    assert "has 1 file(s) whose SHA-256 differs" in err and "rank0/model.safetensors" in err, err
    assert 6_000_000 < doc["uploaded"]["model_bytes"] < 7_500_000, doc["uploaded"]  # that file alone
    from v100plan.remote import split
    from v100plan.remote.release import model_files

    assert victim.read_bytes() == (split.split(demo_model, model_files(demo_model)).dir / "rank0" /
                                   "model.safetensors").read_bytes()
    assert _entry_of(two["root"], B) == entry
    for dep in (A, B):
        assert cli.json("status", server.host_spec, "--deployment", dep)["state"] == "healthy"


def test_a_broken_upload_never_becomes_a_store_entry(cli, env, two, server, other_model):
    """The upload breaks after one file: nothing is in the store under that digest (the partial upload is
    hidden under models/.partial), and the next deploy resumes it and stores it."""
    from v100plan.remote import deploy as dp
    from v100plan.remote import split
    from v100plan.remote.connect import Remote, SshOptions
    from v100plan.remote.errors import RemoteFailed
    from v100plan.remote.host import RemoteSettings, agent
    from v100plan.remote.hosts import parse_host
    from v100plan.remote.release import model_digest, model_files
    from v100plan.remote.supervisor import Paths

    root = two["root"]
    sp = split.split(other_model, model_files(other_model))
    digest = model_digest(sp.files)
    rs = RemoteSettings(root=str(root), python=sshd_mod.remote_python())
    target = dp.Target(parse_host(server.host_spec),
                       SshOptions(known_hosts=str(server.known_hosts), identity=str(server.user_key)), rs, C)
    paths = Paths(str(root), C)
    with Remote(target.spec, target.ssh) as remote:
        real, calls = remote.upload, []

        def breaking(local, dest, *a, **k):
            calls.append(dest)
            if len(calls) > 1:
                raise RemoteFailed("the connection broke (this test)", hint="")
            return real(local, dest, *a, **k)

        remote.upload = breaking
        with pytest.raises(RemoteFailed):
            dp._upload_model(remote, target, paths, sp.dir, sp.files, digest, lambda s: None, has_rsync=False)
        assert calls and all(c.startswith(paths.model_partial(digest)) for c in calls)
        st = agent(remote, rs, "state", {"root": str(root), "dep": C, "model": digest})
    assert st["model"] is False and not (root / "models" / digest).exists()
    assert (Path(paths.model_partial(digest)) / Path(calls[0]).relative_to(paths.model_partial(digest))).is_file()
    r = _deploy(cli, server, C, other_model, two["ports"][C], "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["uploaded"]["model_bytes"] > 13_000_000
    # the rest only: the file sent before the break was kept (checked by its SHA-256, not sent again)
    assert f"uploading {len(sp.files) - 1} shard file(s)" in sshd_mod.flat(r.stderr), r.stderr
    assert _entry_of(root, C) == root / "models" / digest and not Path(paths.model_partial(digest)).exists()


def test_the_reboot_mechanism_is_chosen_reported_and_added_once(cli, env, two, server):
    """Where systemd --user does not run (this container) the crontab @reboot line is the fallback: deploy
    and status say so; after a second switch of the same deployment the line is there once."""
    from v100plan import documents
    from v100plan.remote import agent

    unit_ok, why_not = agent.systemd_user()
    # a crontab line counts only where a cron daemon runs to read it at boot
    want = agent.UNIT if unit_ok else (agent.CRON if agent._cron_runs() else None)
    a = json.loads(two["a"].stdout)
    assert a["after_reboot"] == want, a
    st = cli.json("status", server.host_spec, "--deployment", B)
    documents.validate(st, "deployment_status")
    assert st["after_reboot"] == want
    if unit_ok:
        pytest.skip("systemd --user runs here: the crontab fallback is not what this host uses")  # not CI's case
    assert why_not and ("systemd --user" in why_not or "lingering" in why_not or "systemctl" in why_not)
    assert "@reboot " in a["after_reboot_detail"]
    if want is None:
        assert "no cron daemon runs here" in a["after_reboot_detail"]
    assert why_not.split(" (")[0] in sshd_mod.flat(two["a"].stderr)
    if shutil.which("crontab") is None:
        return
    run = two["root"] / B / "run"
    assert len(_marked(run)) == 1, _marked(run)  # B switched twice (its first deploy, the 512 one): one line


def test_the_unit_file_is_rendered_and_verified(tmp_path):
    """The systemd user unit a host with systemd --user and lingering gets: rendered for a script whose
    path needs quoting, and checked by systemd-analyze verify where it is installed."""
    from v100plan.remote import agent

    d = tmp_path / "dir with space %n"
    d.mkdir()
    script = d / "boot.sh"
    script.write_text("#!/bin/sh\ntrue\n")
    script.chmod(0o700)
    text = agent.unit_text("v100plan deployment /srv/x/run (front on 127.0.0.1:8000), 100% ours", str(script))
    assert "Type=oneshot" in text and "RemainAfterExit=yes" in text and "WantedBy=default.target" in text
    assert f'ExecStart=/bin/sh "{str(script).replace("%", "%%")}"' in text
    assert agent.unit_name("/srv/x/run") != agent.unit_name("/srv/y/run")
    assert agent.unit_name("/srv/x/run").startswith("v100plan-") and agent.unit_name("/srv/x/run").endswith(".service")
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: the unit was rendered, not verified")
    unit = tmp_path / agent.unit_name(str(d))
    unit.write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    mine = [ln for ln in (r.stdout + r.stderr).splitlines() if unit.name in ln or str(script) in ln]
    assert r.returncode == 0 and not mine, r.stdout + r.stderr
    broken = tmp_path / "v100plan-broken.service"  # the check is real: a unit whose command is not there fails
    broken.write_text(text.replace("ExecStart=/bin/sh ", f"ExecStart={tmp_path / 'no-such-sh'} "))
    assert subprocess.run(["systemd-analyze", "verify", str(broken)], capture_output=True, timeout=60).returncode != 0


def test_remove_drops_a_model_only_once_no_release_links_it(cli, env, two, server):
    from v100plan import documents

    root = two["root"]
    entry, other = _entry_of(root, A), _entry_of(root, C)
    r = cli("remove", server.host_spec, "--deployment", A)
    assert r.exit_code == 2 and "--yes" in sshd_mod.flat(r.stderr)
    assert (root / A).is_dir()
    front = json.loads((root / A / "run" / "front.json").read_text())["pid"]
    r = cli("remove", server.host_spec, "--deployment", A, "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    documents.validate(doc, "remove_outcome")
    assert {"supervisord", "proxy", "rank0", "rank1", "front"} <= set(doc["stopped"]), doc
    assert doc["models_removed"] == [] and entry.is_dir()  # B still links it
    assert not (root / A).exists()
    assert not Path(f"/proc/{front}").exists() or Path(f"/proc/{front}/stat").read_text().split(") ")[-1][0] == "Z"
    if shutil.which("crontab"):
        assert _marked(root / A / "run") == []
    assert cli.json("status", server.host_spec, "--deployment", B)["state"] == "healthy"
    stale = root / "venvs" / "0123456789abcdef"  # a venv no release links any more (an older dependency set)
    stale.mkdir(parents=True)
    c_venv = (root / C / "current" / "venv").resolve()
    r = cli("remove", server.host_spec, "--deployment", B, "--yes", "--venvs", "--json")
    assert r.exit_code == 0, r.stderr
    gone = json.loads(r.stdout)
    assert gone["models_removed"] == [entry.name] and not entry.exists()
    assert stale.name in gone["venvs_removed"] and not stale.exists()
    assert c_venv.is_dir() and c_venv.name not in gone["venvs_removed"]  # C's release runs with it
    assert other.is_dir()  # C's model: C links it
    r = cli("remove", server.host_spec, "--deployment", A, "--yes")
    assert r.exit_code == 2 and "no deployment" in sshd_mod.flat(r.stderr)
