"""What the deploy commands refuse or say before any SSH: inputs a host could only fail on later, and the
texts that name the next command."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

from tests import engine_helpers
from tests import sshd as sshd_mod

demo_dir = engine_helpers.demo_dir

NOBODY = f"root@127.0.0.1:{sshd_mod.free_port()}"  # nothing listens: a command that connected would say so


def test_max_context_1_is_refused_here_with_exit_2(cli, tmp_path):
    r = cli("deploy", NOBODY, "--demo-model", "--max-context", "1")
    assert r.exit_code == 2, r.stderr
    assert "--max-context 1: a request needs at least one prompt and one generated token" in sshd_mod.flat(r.stderr)


def test_a_tokenizer_json_that_is_not_json_is_refused_before_any_upload(cli, tmp_path, demo_dir):
    d = tmp_path / "m"
    shutil.copytree(demo_dir, d)
    (d / "tokenizer.json").write_text("{ this is not a tokenizer")
    r = cli("deploy", NOBODY, "--model", d)
    assert r.exit_code == 2, r.stderr
    err = sshd_mod.flat(r.stderr)
    assert "tokenizer.json is not JSON (Expecting property name enclosed in double quotes, line 1)" in err, err
    assert "SSH" not in err  # refused before connecting


def test_keep_releases_and_drain_timeout_are_checked(cli):
    r = cli("deploy", NOBODY, "--demo-model", "--keep-releases", "0")
    assert r.exit_code == 2 and "--keep-releases must be 1 or more" in sshd_mod.flat(r.stderr)
    r = cli("rollback", NOBODY, "--drain-timeout", "-1")
    assert r.exit_code == 2 and "--drain-timeout must be 0 or more" in sshd_mod.flat(r.stderr)


def test_rollback_after_a_rollback_to_goes_back_where_the_jump_left():
    from v100plan.remote.manage import rollback_candidates

    hist = [{"release": "r512", "why": "rollback", "from": "r256"}, {"release": "r1", "why": "rollback", "from": "r512"},
            {"release": "r256", "why": "rollback --to", "from": "r1"}]
    st = {"history": hist, "current": "r256", "releases": ["r1", "r256", "r512"]}
    assert rollback_candidates(st) == ["r1", "r512"]
    st = {"history": hist[:2], "current": "r1", "releases": ["r1", "r256", "r512"]}
    assert rollback_candidates(st) == []  # two plain steps back left both others: nothing further back


def test_the_fault_injection_waiver_names_the_deploy_flag():
    from v100plan.accept.faults import _needs_control

    why = _needs_control(SimpleNamespace(is_engine=True, fault_control=False, server="v100plan"))
    assert "`v100plan deploy --enable-fault-injection`" in why


def test_the_inventory_format_is_the_probes(cli, tmp_path):
    inv = tmp_path / "hosts.txt"
    inv.write_text("# fleet\nroot@127.0.0.1:1\nnot a host!\n")
    r = cli("status", "--inventory", inv)
    assert r.exit_code == 2 and "line 3" in sshd_mod.flat(r.stderr)
