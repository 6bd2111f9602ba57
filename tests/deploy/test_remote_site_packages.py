"""`--remote-site-packages`: the host's venvs see its interpreter's site, so a torch the host already
has (an NGC image, conda, a system venv) is used instead of installing a second one.

The fake host is a real sshd on 127.0.0.1 whose sessions have no package index at all
(``PIP_NO_INDEX=1``, ``PIP_CONFIG_FILE=/dev/null``: pip can install nothing there), and whose
--remote-python is this test run's own venv interpreter: it has torch 2.13.0 (CPU) and every
engine package in its site. That interpreter is itself a venv, the case of a host whose torch lives
in /opt/torch/.venv: a venv made by it sees the base installation's site, not its own, which the
agent's .pth link covers. One real deploy for the module; the probe venv and the engine venv are
built in the session's shared remote root (site venvs have ids of their own).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests import sshd as sshd_mod

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sshd_mod.available() is not None, reason=str(sshd_mod.available()))]

DEP = f"site-{os.getpid()}"
SITE_PYTHON = str(Path(sys.prefix) / "bin" / "python")   # this repo's .venv/bin/python in CI and here
SITE_DIR = sysconfig.get_path("purelib")                 # where its torch lives
NO_INDEX = "SetEnv PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null\n"


def _torch_version() -> str:
    from importlib import metadata

    return metadata.version("torch")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = sshd_mod.make_sshd(tmp_path_factory.mktemp("sshd-site"))
    s.extra_config = NO_INDEX
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def local_home(tmp_path_factory):
    return tmp_path_factory.mktemp("v100plan-home-site")


def _point_at(mp, server, root, local_home) -> None:
    sshd_mod.remote_env(mp, server, root)
    mp.setenv("V100PLAN_REMOTE_PYTHON", SITE_PYTHON)
    mp.setenv("V100PLAN_HOME", str(local_home))
    mp.delenv("V100PLAN_REMOTE_SITE_PACKAGES", raising=False)


@pytest.fixture
def env(monkeypatch, server, tmp_path_factory, local_home):
    root = sshd_mod.shared_remote_root(tmp_path_factory)
    _point_at(monkeypatch, server, root, local_home)
    return root


def _snapshot(root: Path) -> dict[str, tuple]:
    out = {}
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(base, name))
            out[os.path.relpath(os.path.join(base, name), root)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, server, local_home):
    """probe --host, a dry run of the deploy, then the deploy itself, all with --remote-site-packages."""
    from tests.conftest import Cli

    root = sshd_mod.shared_remote_root(tmp_path_factory)
    mp = pytest.MonkeyPatch()
    _point_at(mp, server, root, local_home)
    port = sshd_mod.free_port()
    common = ("--deployment", DEP, "--port", port, "--health-timeout", "90", "--json", "--remote-site-packages")
    try:
        probe = Cli()("probe", "--quick", "--json", "--host", server.host_spec, "--remote-site-packages")
        before = _snapshot(root)
        dry = Cli()("deploy", server.host_spec, "--demo-model", "--dry-run", *common)
        dry_unchanged = before == _snapshot(root)
        deploy = Cli()("deploy", server.host_spec, "--demo-model", *common)
        yield {"probe": probe, "dry": dry, "dry_unchanged": dry_unchanged, "deploy": deploy, "root": root}
        Cli()("stop", server.host_spec, "--deployment", DEP, "--remote-site-packages")
    finally:
        mp.undo()


def _venv_dir(root: Path, vid: str) -> Path:
    return root / "venvs" / vid


def _site_packages(venv: Path) -> Path:
    found = list(venv.glob("lib/python*/site-packages"))
    assert len(found) == 1, found
    return found[0]


def test_probe_host_builds_a_site_venv_without_an_index(runs, env, cli, server):
    from v100plan.remote import venv as venv_mod

    r = runs["probe"]
    assert r.exit_code == 3, r.stderr  # no GPU here: every case waived, said so
    assert json.loads(r.stdout)["overall"] == "nothing_measured"
    err = sshd_mod.flat(r.stderr)
    assert "site packages" in err and "taken from the host's site" in err
    vid = venv_mod.venv_id(SITE_PYTHON, venv_mod.probe_requirements(), None, site_packages=True)
    assert vid != venv_mod.venv_id(SITE_PYTHON, venv_mod.probe_requirements(), None)
    v = _venv_dir(env, vid)
    assert "include-system-site-packages = true" in (v / "pyvenv.cfg").read_text()
    deps = json.loads((v / ".v100plan-deps.json").read_text())
    assert deps["installed"] == [] and [p["name"] for p in deps["from_site"]] == ["nvidia-ml-py"]
    # the same setting through its environment variable: the warm path, the same venv, nothing built
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("V100PLAN_REMOTE_SITE_PACKAGES", "1")
    try:
        r2 = cli("probe", "--quick", "--json", "--host", server.host_spec)
    finally:
        monkeypatch.undo()
    assert r2.exit_code == 3, r2.stderr
    assert "building the venv" not in r2.stderr and "uploading" not in r2.stderr


def test_dry_run_says_the_venv_will_see_the_site(runs):
    r = runs["dry"]
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    acts = "\n".join(doc["actions"])
    assert "--system-site-packages" in acts and "nothing to install (no package index needed)" in acts
    assert re.search(rf"from there: torch {re.escape(_torch_version())}, .*\(in {re.escape(SITE_DIR)}\)", acts), acts
    site = doc["site_packages"]
    assert site["python"] == SITE_PYTHON and site["to_install"] == []
    assert {p["name"] for p in site["from_site"]} >= {"torch", "numpy", "fastapi", "supervisor"}
    assert "would: " in sshd_mod.flat(r.stderr)
    assert runs["dry_unchanged"], "the dry run changed the remote tree"


def test_deploy_takes_torch_from_the_site_and_installs_nothing(runs, env, cli, server):
    from v100plan.remote import venv as venv_mod

    r = runs["deploy"]
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["changed"] and doc["restarted"]
    torch = [p for p in doc["site_packages"]["from_site"] if p["name"] == "torch"]
    assert torch == [{"requirement": "torch", "name": "torch", "version": _torch_version(), "path": SITE_DIR}]
    err = sshd_mod.flat(r.stderr)
    assert re.search(rf"taken from the host's site: torch {re.escape(_torch_version())}, .*\(in {re.escape(SITE_DIR)}\)"
                     "; installed into the venv: nothing", err), err

    # the venv: made with --system-site-packages, no torch of its own, an id apart from the isolated one's
    man = json.loads((env / DEP / "current" / "manifest.json").read_text())
    reqs = venv_mod.engine_requirements(None, site_packages=True)
    assert reqs[0] == "torch" and man["requirements"] == sorted(reqs)
    assert man["venv_id"] == venv_mod.venv_id(SITE_PYTHON, reqs, None, site_packages=True)
    assert man["venv_id"] != venv_mod.venv_id(SITE_PYTHON, venv_mod.engine_requirements(), None)
    v = _venv_dir(env, man["venv_id"])
    assert os.path.realpath(env / DEP / "current" / "venv") == os.path.realpath(v)
    assert "include-system-site-packages = true" in (v / "pyvenv.cfg").read_text()
    sp = _site_packages(v)
    assert not (sp / "torch").exists() and not list(sp.glob("torch-*.dist-info"))
    if sys.prefix != sys.base_prefix:  # the interpreter is a venv: its site reaches the new venv by a .pth
        assert (sp / "_v100plan_site.pth").read_text().split() == [SITE_DIR]
    else:  # a plain installation: --system-site-packages alone shows its site
        assert not (sp / "_v100plan_site.pth").exists()
    # what the service's interpreter imports is the site's torch
    where = subprocess.run([str(v / "bin" / "python"), "-c", "import torch; print(torch.__file__)"],
                           capture_output=True, text=True, timeout=120)
    assert where.returncode == 0 and where.stdout.strip().startswith(SITE_DIR + "/torch/"), where

    st = cli.json("status", server.host_spec, "--deployment", DEP, "--remote-site-packages")
    assert st["state"] == "healthy" and st["release"] == doc["release"]
    assert st["site_packages"] == doc["site_packages"]["from_site"]  # status says what the venv takes from there
    # redeploy: nothing changed, and the report names what the venv takes from the site now, read from
    # the venv itself (not the record of its build, made stale here on purpose)
    deps_file = v / ".v100plan-deps.json"
    recorded = deps_file.read_text()
    stale = json.loads(recorded)
    stale["from_site"] = [{**p, "version": "0.0-stale"} for p in stale["from_site"]]
    deps_file.write_text(json.dumps(stale))
    try:
        again = cli("deploy", server.host_spec, "--demo-model", "--deployment", DEP, "--port",
                    str(man["engine"]["port"]), "--json", "--remote-site-packages")
    finally:
        deps_file.write_text(recorded)
    assert again.exit_code == 0, again.stderr
    doc2 = json.loads(again.stdout)
    assert doc2["changed"] is False and doc2["uploaded_bytes"] == 0
    assert doc2["site_packages"]["from_site"] == doc["site_packages"]["from_site"]
    # the table a user reads says it too
    table = cli("deploy", server.host_spec, "--demo-model", "--deployment", DEP, "--port",
                str(man["engine"]["port"]), "--remote-site-packages")
    assert table.exit_code == 0, table.stderr
    row = [ln for ln in table.stdout.splitlines() if "from the host's site" in ln]
    assert row and f"torch {_torch_version()}" in row[0], table.stdout


def test_bad_combinations_are_errors_with_a_hint(env, cli, server):
    # an interpreter that is not there
    r = cli("probe", "--quick", "--host", server.host_spec, "--remote-site-packages",
            "--remote-python", "/nonexistent/bin/python3")
    assert r.exit_code == 4, (r.exit_code, r.stderr)
    err = sshd_mod.flat(r.stderr)
    assert "Error: " in r.stderr
    assert "'/nonexistent/bin/python3' is not there" in err and "--remote-python" in err
    assert "Traceback" not in r.stderr

    # a torch pin the site does not satisfy, on a host with no package index: pip cannot get it
    root = env

    def venvs() -> list[str]:
        return sorted(p.name for p in (root / "venvs").iterdir() if p.is_dir()) if (root / "venvs").is_dir() else []

    cli("probe", "--quick", "--host", server.host_spec, "--remote-site-packages")  # its venv, if not made yet
    before = venvs()
    r = cli("deploy", server.host_spec, "--demo-model", "--deployment", f"{DEP}-pin",
            "--remote-site-packages", "--torch", "torch==2.0.0")
    assert r.exit_code == 4, (r.exit_code, r.stderr)
    err = sshd_mod.flat(r.stderr)
    assert re.search(r"Error: .*does not hold torch==2\.0\.0 \(it has torch " + re.escape(_torch_version()), err), err
    assert "--remote-python" in err and "index" in err and "without --torch any torch the site has will do" in err
    assert "Traceback" not in r.stderr
    assert venvs() == before  # the half-built venv is gone
    assert not (root / f"{DEP}-pin" / "current").exists()


def test_a_site_torch_without_kernels_for_the_card_stops_the_deploy():
    """The recorded H200 host's torch (2.11.0+cu130, arch list from sm_75, in /opt/torch/.venv) seen
    through --remote-site-packages on the V100 pair of the field recording: the deploy names the site's
    torch and its path, and the fix (a CUDA 12.x build by --torch with an index)."""
    from tests.remote_support import v100_pair_with_h200_torch
    from v100plan.remote.deploy import torch_gap

    v100, h200 = v100_pair_with_h200_torch()
    site_path = "/opt/torch/.venv/lib/python3.12/site-packages"
    site = {"python": "/opt/torch/.venv/bin/python3",
            "from_site": [{"requirement": "torch", "name": "torch", "version": h200["host"]["torch_version"],
                           "path": site_path}]}
    problem = torch_gap(v100, "ops@v100-box", site)
    assert problem is not None and problem.exit_code == 4
    assert f"torch {h200['host']['torch_version']} from the host's site ({site_path}" in problem.message
    assert "sm_70" in problem.message and "--remote-site-packages" in problem.message
    assert "--torch" in problem.hint and "cu126" in problem.hint and "CUDA 12.x" in problem.hint
    # the same torch covering its own card: no gap, site or not
    assert torch_gap(h200, "ops@h200", site) is None
    # a venv that installed its own torch (the site had no torch): the venv's wording, not the site's
    plain = torch_gap(v100, "ops@v100-box", {"python": "python3", "from_site": []})
    assert plain is not None and "in the host's venv" in plain.message


def test_a_host_without_room_for_the_shards_is_told_before_the_upload(env, cli, server, tmp_path, monkeypatch):
    """A remote root on a 12 MB filesystem (a real tmpfs; the venvs see the site, so they are tiny): the
    13.4 MB of shards do not fit, which the deploy says before it sends any of them (exit 4), instead of
    a disk-full error half-way through the transfer."""
    small = tmp_path / "small-root"
    small.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m,mode=0700", "tmpfs", str(small)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and a mountable tmpfs for a small filesystem")
    try:
        monkeypatch.setenv("V100PLAN_REMOTE_ROOT", str(small))
        r = cli("deploy", server.host_spec, "--demo-model", "--deployment", DEP + "-small", "--port",
                sshd_mod.free_port(), "--remote-site-packages", "--health-timeout", "60")
        assert r.exit_code == 4, r.stderr
        err = sshd_mod.flat(r.stderr)
        assert "MB of shards to upload, but only" in err and "nothing was sent" in err, err
        assert "rsync resumes" not in err
        models = small / (DEP + "-small") / "models"
        assert not [p for p in models.rglob("*") if p.is_file()], "shard bytes were sent anyway"
    finally:
        import time

        deadline = time.monotonic() + 15  # the host side of the SSH session (the lock's helper) ends just after
        while subprocess.run(["umount", str(small)], capture_output=True).returncode != 0:
            if time.monotonic() > deadline:
                subprocess.run(["umount", "-l", str(small)], check=False)
                break
            time.sleep(0.2)
