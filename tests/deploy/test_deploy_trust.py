"""Deploy ships only what is the operator's own: the local cache (the demo model, the split shards) and the
host's remote root are used only when they belong to the user and nobody else can write to them, and
shards keep 0600 files in 0700 folders here and on the host.

The attacks are the ones found by hand (a second local user on the same machine, against the real sshd
of the suite): another user makes the operator's cache folder first, in a shared temp folder (what
`$TMPDIR/v100plan-<uid>` was), and plants a `demo-model/` or a `shards/<digest>-tp2/` with its checksum
record recomputed. The planted state is made as root and handed to the second user with chown: the
folders and files on disk are exactly what that user would have made.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from tests import sshd as sshd_mod
from tests.deploy_support import *  # noqa: F403 - the shared fixtures

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sshd_mod.available() is not None, reason=str(sshd_mod.available()))]

DEP = f"trust-{os.getpid()}"


def _give(path: Path, user) -> None:  # noqa: ANN001 - (name, uid, gid)
    """Everything under ``path`` (and it) owned by ``user``: what that user planting it would leave."""
    _, uid, gid = user
    for base, dirs, files in os.walk(path):
        os.chown(base, uid, gid)
        for f in files:
            os.chown(os.path.join(base, f), uid, gid)


def _planted_model(demo_model: Path, dest: Path) -> Path:
    shutil.copytree(demo_model, dest)
    (dest / "README.md").write_text("planted by another user\n")
    return dest


def test_the_default_home_is_the_users_own_never_a_shared_temp_folder(monkeypatch, shared_tmp, tmp_path):
    from v100plan.remote import split

    monkeypatch.delenv("V100PLAN_HOME")
    monkeypatch.setenv("TMPDIR", str(shared_tmp))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert split.home() == tmp_path / "cache" / "v100plan"
    assert stat.S_IMODE((tmp_path / "cache" / "v100plan").stat().st_mode) == 0o700
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    (tmp_path / "h").mkdir()
    assert split.home() == tmp_path / "h" / ".cache" / "v100plan"
    assert list(shared_tmp.iterdir()) == []  # nothing in the shared temp folder


def test_a_planted_demo_model_is_refused_naming_the_folder_and_its_owner(cli, env, server, port, demo_model,
                                                                        other_user, shared_tmp, monkeypatch):
    planted_home = shared_tmp / f"v100plan-{os.getuid()}"  # where the cache used to be: $TMPDIR/v100plan-<uid>
    planted_home.mkdir()
    _planted_model(demo_model, planted_home / "demo-model")
    _give(planted_home, other_user)
    monkeypatch.setenv("V100PLAN_HOME", str(planted_home))
    r = cli("deploy", server.host_spec, "--demo-model", "--deployment", DEP, "--port", port)
    assert r.exit_code == 4, r.stdout + r.stderr
    err = sshd_mod.flat(r.stderr)
    assert f"{planted_home} is owned by {other_user[0]} (uid {other_user[1]})" in err, err
    assert not (env / DEP).exists()  # nothing reached the host


def test_planted_shards_with_a_recomputed_record_are_refused(cli, env, server, port, demo_model, other_user,
                                                             shared_tmp, monkeypatch, tmp_path):
    """The operator deploys their own genuine model; the split cache holds another user's shards for its
    digest (computable: the model is public), with `.v100plan-sha256.json` recomputed to match them."""
    from v100plan.remote import release as rel
    from v100plan.remote import split

    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("V100PLAN_HOME", str(home))
    genuine = split.split(demo_model, rel.model_files(demo_model))  # what the attacker reproduces, then alters
    planted = genuine.dir
    (planted / "rank0" / "README.md").write_text("planted\n")
    (planted / split.RECORD).write_text(json.dumps(rel.hash_files(planted)))
    _give(planted, other_user)
    r = cli("deploy", server.host_spec, "--model", demo_model, "--deployment", DEP, "--port", port)
    assert r.exit_code == 4, r.stdout + r.stderr
    err = sshd_mod.flat(r.stderr)
    assert f"cached split {planted} is owned by {other_user[0]} (uid {other_user[1]})" in err, err
    assert "uploading" not in err and not (env / DEP).exists()

    # the same shards in a home another user can write to (a folder left 0777 in a shared temp folder)
    open_home = shared_tmp / "open-home"
    shutil.copytree(home, open_home)
    open_home.chmod(0o777)
    monkeypatch.setenv("V100PLAN_HOME", str(open_home))
    r = cli("deploy", server.host_spec, "--model", demo_model, "--deployment", DEP, "--port", port, "--dry-run")
    assert r.exit_code == 4, r.stdout + r.stderr
    assert f"v100plan home {open_home} is writable by other users (mode 777)" in sshd_mod.flat(r.stderr)


def test_a_remote_root_of_another_user_is_refused(cli, env, server, other_user, shared_tmp, monkeypatch):
    root = shared_tmp / "their-root"
    root.mkdir()
    _give(root, other_user)
    monkeypatch.setenv("V100PLAN_REMOTE_ROOT", str(root))
    r = cli("status", server.host_spec, "--deployment", DEP)
    assert r.exit_code == 4, r.stdout + r.stderr
    err = sshd_mod.flat(r.stderr)
    assert f"remote root {root} is owned by {other_user[0]} (uid {other_user[1]})" in err, err
    assert list(root.iterdir()) == []


def test_shards_are_0600_in_0700_folders_here_and_on_the_host(env, server, demo_model):
    from v100plan.remote import deploy as dp
    from v100plan.remote import release as rel
    from v100plan.remote import split
    from v100plan.remote.connect import Remote, SshOptions
    from v100plan.remote.host import RemoteSettings
    from v100plan.remote.hosts import parse_host
    from v100plan.remote.supervisor import Paths

    sp = split.split(demo_model, rel.model_files(demo_model))

    def modes(d: Path) -> set[tuple[str, int]]:
        return {("dir" if p.is_dir() else "file", stat.S_IMODE(p.stat().st_mode)) for p in [d, *d.rglob("*")]}

    assert modes(sp.dir) == {("dir", 0o700), ("file", 0o600)}
    dep = f"{DEP}-modes"
    target = dp.Target(parse_host(server.host_spec),
                       SshOptions(known_hosts=str(server.known_hosts), identity=str(server.user_key)),
                       RemoteSettings(root=str(env), python=sshd_mod.remote_python()), dep)
    paths, digest = Paths(str(env), dep), rel.model_digest(sp.files)
    with Remote(target.spec, target.ssh) as remote:
        dp._upload_model(remote, target, paths, sp.dir, sp.files, digest, lambda s: None, has_rsync=False)
    up = Path(paths.model_partial(digest))
    assert modes(up) == {("dir", 0o700), ("file", 0o600)}
    shutil.rmtree(up)


def test_the_rules_for_folders_above_and_links_on_the_way(tmp_path, shared_tmp, other_user):
    from v100plan.remote import trusted

    mine = trusted.private_dir(shared_tmp / "mine" / "cache")  # a sticky, world-writable folder above: fine
    assert stat.S_IMODE(os.stat(shared_tmp / "mine").st_mode) == 0o700 and os.path.isdir(mine)
    link = shared_tmp / "their-link"  # another user's link to my own folder: they can point it elsewhere
    link.symlink_to(shared_tmp / "mine")
    os.lchown(link, other_user[1], other_user[2])
    with pytest.raises(trusted.Untrusted, match=f"{link}, above it, is owned by {other_user[0]}"):
        trusted.check_private(link / "cache")
    open_dir = tmp_path / "open"  # a folder above that others can write to, and not sticky
    (open_dir / "inner").mkdir(parents=True)
    open_dir.chmod(0o777)
    with pytest.raises(trusted.Untrusted, match="writable by other users .mode 777. and not sticky"):
        trusted.check_private(open_dir / "inner")
