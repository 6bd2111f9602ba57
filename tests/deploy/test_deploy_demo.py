"""`v100plan deploy` of the demo model to a real sshd on 127.0.0.1, then everything an operator does
next: idempotent redeploy, dry runs, the lock, a second release, rollback, a release that fails its
health check (rolled back automatically), the service reached through an SSH port forward, logs, stop.

One deployment for the module (the steps build on each other, as on a real host); the remote venv
is the session's shared one, built once per dependency set. The deploys share one local v100plan
home, so the model is split into its two shards once and the later deploys reuse the split.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests import sshd as sshd_mod
from tests.deploy_support import *  # noqa: F403 - the shared fixtures
from tests.deploy_support import live_slot, module_env, tree

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sshd_mod.available() is not None, reason=str(sshd_mod.available()))]

DEP = f"demo-{os.getpid()}"  # fresh in a kept remote root too


@pytest.fixture(scope="module")
def broken_model(tmp_path_factory, demo_model):
    """The demo model with a config that claims one layer more than its weights hold: it splits (the
    split follows the tensors there are), but the ranks cannot fill the missing layer, /health never passes."""
    d = tmp_path_factory.mktemp("models") / "broken"
    shutil.copytree(demo_model, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _deploy(cli, server, port, model, *extra):
    return cli("deploy", server.host_spec, "--model", model, "--deployment", DEP, "--port", port,
               "--health-timeout", "90", "--json", *extra)


@pytest.fixture(scope="module")
def first(tmp_path_factory, server, port, demo_model, bundle_snapshot, local_home):
    """The first deploy, as the CLI reports it (run once; the tests below build on it)."""
    from tests.conftest import Cli

    with module_env(server, tmp_path_factory, bundle_snapshot, local_home) as root:
        before, home_before = tree(root), tree(local_home)
        dry = Cli()("deploy", server.host_spec, "--model", demo_model, "--deployment", DEP, "--port", port,
                    "--dry-run", "--json")
        after_dry, home_after_dry = tree(root), tree(local_home)
        r = _deploy(Cli(), server, port, demo_model)
        yield {"dry": dry, "dry_unchanged": before == after_dry, "dry_split_nothing": home_before == home_after_dry,
               "result": r, "root": root}
        Cli()("stop", server.host_spec, "--deployment", DEP)  # whatever the tests left running


def test_dry_run_on_a_fresh_host_changes_nothing(first):
    r = first["dry"]
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["dry_run"] is True and doc["changed"] is True  # what the deploy would do: it changes the host
    acts = "\n".join(doc["actions"])
    assert "locally into 2 tensor-parallel shards" in acts and "13.1 MB of weights" in acts
    assert "upload the shards (shard.json, rank0/, rank1/)" in acts and "start release" in acts and "switch" in acts
    assert doc["release"] is None  # the manifest lists the shards' SHA-256: unknown until they are made
    assert "would: " in sshd_mod.flat(r.stderr)
    assert first["dry_unchanged"], "the dry run changed the remote tree"
    assert first["dry_split_nothing"], "the dry run split the model (or wrote the local cache)"


def test_first_deploy_passes_health_and_smoke(first, server, port, demo_model):
    r = first["result"]
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["changed"] and doc["restarted"] and doc["previous"] is None
    assert doc["uploaded_bytes"] > 13_000_000  # the two shards went over (13.4 MB with the embeddings in both)
    err = sshd_mod.flat(r.stderr)
    assert re.search(r"split into 2 shards locally: 6\.\d, 6\.\d MB per rank", err), err
    assert doc["split"]["cached"] is False and doc["split"]["files"] == 9
    # both ends have rsync here (.ci/run installs it): the shards go by rsync over ssh
    assert ("rsync over ssh" if shutil.which("rsync") else "SFTP") in err
    d = first["root"] / DEP
    assert os.readlink(d / "current") == f"releases/{doc['release']}"
    man = json.loads((d / "current" / "manifest.json").read_text())
    assert man["engine"]["port"] == port
    # the release's model is the split: shard.json and one directory per rank, no unsplit weights
    model = d / "current" / "model"
    assert sorted(p.name for p in model.iterdir() if not p.name.startswith(".")) == ["rank0", "rank1", "shard.json"]
    on_host = {p.relative_to(model).as_posix() for p in model.rglob("*") if p.is_file()} - {".v100plan-verified"}
    assert set(man["model"]["files"]) == on_host  # the manifest's checksums cover every uploaded file
    for rank_dir in ("rank0", "rank1"):
        assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in (model / rank_dir).iterdir()}
    from v100plan.remote.release import model_digest, model_files

    assert man["model"]["sharding"] == {"tp": 2, "source": model_digest(model_files(demo_model))}
    assert json.loads((model / "shard.json").read_text())["tp"] == 2
    key = d / "api_key"
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    assert key.read_text().strip() not in r.stdout + r.stderr  # the key is never printed


def test_status_reports_a_healthy_service(cli, env, first, server):
    doc = cli.json("status", server.host_spec, "--deployment", DEP)
    assert doc["state"] == "healthy" and doc["health_status"] == 200
    assert doc["allreduce"] == "gloo"  # /health asked with the key: its details, not only its status
    assert doc["release"] == json.loads(first["result"].stdout)["release"]
    assert len(doc["ranks"]) == 2 and all(isinstance(p, int) for p in doc["ranks"])
    assert doc["uptime_s"] is not None and doc["uptime_s"] >= 0


def test_second_deploy_with_nothing_changed_uploads_nothing_restarts_nothing(cli, env, first, server, port,
                                                                             demo_model):
    before = cli.json("status", server.host_spec, "--deployment", DEP)
    r = _deploy(cli, server, port, demo_model)
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert "nothing changed" in sshd_mod.flat(r.stderr), r.stderr
    assert doc["uploaded_bytes"] == 0 and doc["restarted"] is False and doc["changed"] is False
    assert doc["split"]["cached"] is True and "nothing split" in sshd_mod.flat(r.stderr)
    assert doc["release"] == json.loads(first["result"].stdout)["release"]
    after = cli.json("status", server.host_spec, "--deployment", DEP)
    assert after["supervisord_pid"] == before["supervisord_pid"] and after["ranks"] == before["ranks"]


def test_a_shard_file_damaged_after_upload_is_caught_by_its_checksum(env, first, server, demo_model):
    """One byte of rank 1's weights flipped on the host right after the transfer (what a bad disk or a
    broken copy does): the SHA-256 check after the upload names the file and the shards are not marked
    verified; the next run sends that file anew and passes."""
    from v100plan.errors import EnvironmentProblem
    from v100plan.remote import deploy as dp
    from v100plan.remote import split
    from v100plan.remote.connect import Remote, SshOptions
    from v100plan.remote.host import RemoteSettings
    from v100plan.remote.hosts import parse_host
    from v100plan.remote.release import model_digest, model_files
    from v100plan.remote.supervisor import Paths

    sp = split.split(demo_model, model_files(demo_model))
    assert sp.cached  # the first deploy's split, reused
    dep = f"{DEP}-damaged"  # its own models/ directory: the running deployment's stays as it is
    target = dp.Target(parse_host(server.host_spec),
                       SshOptions(known_hosts=str(server.known_hosts), identity=str(server.user_key)),
                       RemoteSettings(root=str(first["root"]), python=sshd_mod.remote_python()), dep)
    paths, digest = Paths(str(first["root"]), dep), model_digest(sp.files)
    victim = Path(paths.model_partial(digest)) / "rank1" / "model.safetensors"  # the upload, not yet stored

    def flip_last_byte() -> None:
        if victim.is_file():
            data = bytearray(victim.read_bytes())
            data[-1] ^= 0xFF
            victim.write_bytes(bytes(data))

    said: list[str] = []
    patch = pytest.MonkeyPatch()  # its own: undoing it must not undo env's settings
    with Remote(target.spec, target.ssh) as remote:
        for name in ("rsync", "upload"):
            real = getattr(remote, name)

            def damaging(*a, _real=real, **k):
                sent = _real(*a, **k)
                flip_last_byte()
                return sent

            patch.setattr(remote, name, damaging)
        with pytest.raises(EnvironmentProblem) as caught:
            dp._upload_model(remote, target, paths, sp.dir, sp.files, digest, said.append,
                             has_rsync=bool(shutil.which("rsync")))
        assert "rank1/model.safetensors" in caught.value.message and "SHA-256" in caught.value.message
        assert "rank0/model.safetensors" not in caught.value.message
        assert not (victim.parent.parent / ".v100plan-verified").exists()

        patch.undo()  # the transfer is sound again: run it again, as the hint says
        said.clear()
        dp._upload_model(remote, target, paths, sp.dir, sp.files, digest, said.append,
                         has_rsync=bool(shutil.which("rsync")))
    assert any("removing 1 damaged file(s)" in line and "rank1/model.safetensors" in line for line in said), said
    assert any("uploading 1 shard file(s)" in line for line in said), said
    assert (victim.parent.parent / ".v100plan-verified").exists()
    assert victim.read_bytes() == (sp.dir / "rank1" / "model.safetensors").read_bytes()
    shutil.rmtree(Path(paths.dir), ignore_errors=True)
    shutil.rmtree(Path(paths.model_partial(digest)))


def test_a_model_that_cannot_be_split_is_refused_before_anything_is_sent(cli, env, first, server, port, demo_model,
                                                                        tmp_path):
    """Weights cut short: the local split fails, exit 2 with the reason, and the host is not touched."""
    bad = tmp_path / "cut"
    shutil.copytree(demo_model, bad)
    w = bad / "model.safetensors"
    w.write_bytes(w.read_bytes()[:4096])
    before = tree(first["root"], skip=(f"{DEP}/run",))
    r = _deploy(cli, server, port, bad)
    assert r.exit_code == 2, r.stderr
    err = sshd_mod.flat(r.stderr)
    assert "could not be split into 2 tensor-parallel shards" in err and "Traceback" not in err
    assert tree(first["root"], skip=(f"{DEP}/run",)) == before


def test_service_is_reached_through_an_ssh_forward(first, server, env):
    from v100plan.remote.connect import SshOptions
    from v100plan.remote.service import open_service

    ssh = SshOptions(known_hosts=str(server.known_hosts), identity=str(server.user_key))
    with open_service(server.host_spec, str(first["root"]), DEP, ssh=ssh, python=sshd_mod.remote_python()) as svc:
        assert svc.endpoint.startswith("http://127.0.0.1:") and not svc.endpoint.endswith(f":{svc.remote_port}")
        assert svc.api_key not in repr(svc)
        auth = {"Authorization": f"Bearer {svc.api_key}", "Content-Type": "application/json"}
        req = urllib.request.Request(svc.endpoint + "/v1/models", headers=auth)
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.read())["data"][0]["id"] == "v100plan-demo"
        # the rank logs read are this session's: the files hold earlier requests (the deploy's smoke
        # completion at least; request ids restart with every proxy), the reader only the one made now
        held = (live_slot(first["root"] / DEP) / "logs" / "rank0.g1.log").read_text()
        assert "request r1 " in held
        body = json.dumps({"model": "v100plan-demo", "prompt": "Hello", "max_tokens": 3, "temperature": 0}).encode()
        with urllib.request.urlopen(urllib.request.Request(svc.endpoint + "/v1/completions", body, auth),
                                    timeout=60) as resp:
            answer = json.loads(resp.read())
        assert answer["usage"]["completion_tokens"] == 3
        # the ranks serve their own shards, and answer what one process answers on the unsplit model
        from tests.test_service_support import expected_tokens, prompt_ids

        assert answer["v100plan"]["token_ids"] == expected_tokens(prompt_ids("Hello"), 3)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all("request " in t for t in svc.read_rank_logs().values()):
            time.sleep(0.2)
        logs = svc.read_rank_logs()
        assert set(logs) == {0, 1}
        for text in logs.values():
            assert text.count(" request ") == 1 and "finish=length steps=" in text, text
        assert '"event"' in svc.read_service_log()  # the proxy's structured log (serve --log-file)
        assert svc.engine["tp"] == 2 and svc.engine["devices"] == ["cpu", "cpu"] and svc.supervised


def test_a_second_deploy_waits_for_the_lock(cli, env, first, server, port, demo_model):
    from v100plan.remote.connect import Remote, SshOptions
    from v100plan.remote.deploy import held_lock
    from v100plan.remote.host import RemoteSettings
    from v100plan.remote.hosts import parse_host

    ssh = SshOptions(known_hosts=str(server.known_hosts), identity=str(server.user_key))
    rs = RemoteSettings(root=str(first["root"]), python=sshd_mod.remote_python())
    with Remote(parse_host(server.host_spec), ssh) as other, held_lock(other, rs, f"{first['root']}/{DEP}/deploy.lock",
                                                                       "deploy by another operator"):
        r = _deploy(cli, server, port, demo_model, "--max-context", "512")
        assert r.exit_code == 4, r.stderr
        err = sshd_mod.flat(r.stderr)
        assert "another operation holds" in err and "deploy by another operator" in err
        st = cli.json("status", server.host_spec, "--deployment", DEP)  # names who holds the lock
        assert st["state"] == "healthy" and "deploy by another operator" in st["lock_holder"]
    # the lock went with the other session: the same deploy now gets it (dry run: read-only)
    r = _deploy(cli, server, port, demo_model, "--max-context", "512", "--dry-run")
    assert r.exit_code == 0, r.stderr


def test_dry_run_of_a_change_leaves_the_deployment_untouched(cli, env, first, server, port, demo_model):
    root = first["root"]
    before = tree(root, skip=(f"{DEP}/run",))  # the running service writes its own logs there
    r = _deploy(cli, server, port, demo_model, "--max-context", "512", "--dry-run")
    assert r.exit_code == 0, r.stderr
    acts = "\n".join(json.loads(r.stdout)["actions"])
    assert "reuse venv" in acts and "reuse model" in acts and "; stop release" in acts
    assert "which keeps serving" in acts  # blue/green on CPU: the new release starts beside the serving one
    assert tree(root, skip=(f"{DEP}/run",)) == before


def test_new_release_then_rollback(cli, env, first, server, port, demo_model):
    first_id = json.loads(first["result"].stdout)["release"]
    r = _deploy(cli, server, port, demo_model, "--max-context", "512")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["release"] != first_id and doc["previous"] == first_id
    assert doc["uploaded_bytes"] == 0  # bundle, venv and model were all there already
    d = first["root"] / DEP
    assert (d / "releases" / first_id).is_dir()  # the previous release is kept
    st = cli.json("status", server.host_spec, "--deployment", DEP)
    assert st["state"] == "healthy" and st["engine"]["max_context"] == 512

    r = cli("rollback", server.host_spec, "--deployment", DEP, "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["release"] == first_id
    assert os.readlink(d / "current") == f"releases/{first_id}"
    st = cli.json("status", server.host_spec, "--deployment", DEP)
    assert st["state"] == "healthy" and st["release"] == first_id and st["engine"]["max_context"] is None


def test_deploy_then_accept_over_ssh_then_rollback(cli, env, first, server, port, demo_model, tmp_path):
    """The operator's loop in one test: deploy with the fault control on (and nothing else: the deployed
    watchdog defaults), qualify the host with the acceptance suite over SSH (every fault scenario once,
    injected through the forward, rank logs fetched), roll back."""
    d = first["root"] / DEP
    before = os.readlink(d / "current")
    r = _deploy(cli, server, port, demo_model, "--enable-fault-injection")
    assert r.exit_code == 0, r.stderr
    out = tmp_path / "report"
    r = cli("accept", "--host", server.host_spec, "--deployment", DEP, "--model-dir", demo_model,
            "--repeats", "1", "--requests", "16", "--clients", "4", "--out", out)
    assert r.exit_code == 0, r.stderr[-3000:]
    doc = json.loads((out / "report.json").read_text())
    assert doc["verdict"] == "passed" and doc["target"]["mode"] == "host"
    assert doc["target"]["fault_control"] is True and doc["target"]["endpoint"].startswith("http://127.0.0.1:")
    status = {s["key"]: s["status"] for s in doc["scenarios"]}
    for key in ("completion", "stream", "stream_cancel", "tp2_equals_tp1", "rank_logs_agree", "auth", "prefix_reuse",
                "kill_rank1", "kill_rank0", "freeze_rank1", "corrupt_hash", "stall_allreduce", "kill_proxy",
                "restart_storm", "load"):
        assert status[key] == "passed", (key, [s for s in doc["scenarios"] if s["key"] == key])
    # the failure causes were checked (the deployed service log over SFTP), freeze and stall by heartbeat
    assert not any("cause was not checked" in (s.get("reason") or "") for s in doc["scenarios"])
    assert doc["target"]["limits"]["liveness_timeout_s"] is not None
    key = Path(d / "api_key").read_text().strip()
    for name in ("report.json", "report.html", "junit.xml"):
        assert key not in (out / name).read_text()

    r = cli("rollback", server.host_spec, "--deployment", DEP, "--json")
    assert r.exit_code == 0, r.stderr
    assert os.readlink(d / "current") == before
    assert cli.json("status", server.host_spec, "--deployment", DEP)["state"] == "healthy"


def test_release_failing_its_health_check_is_rolled_back(cli, env, first, server, port, broken_model):
    d = first["root"] / DEP
    current = os.readlink(d / "current")
    r = cli("deploy", server.host_spec, "--model", broken_model, "--deployment", DEP, "--port", port,
            "--health-timeout", "20", "--json")
    assert r.exit_code == 1, r.stderr
    err = sshd_mod.flat(r.stderr)
    assert "failed its checks; release" in err and "kept serving throughout" in err, err
    assert "/health did not pass" in err or "the new release's proxy ended" in err, err
    assert os.readlink(d / "current") == current
    st = cli.json("status", server.host_spec, "--deployment", DEP)
    assert st["state"] == "healthy" and f"releases/{st['release']}" == current


def test_deploy_takes_the_plans_settings(cli, env, first, server, port, demo_model, tmp_path):
    """A plan made for the demo model on two V100s: the bundled engine takes its tp2 strategy's
    allreduce path, the launch dtype and context limit (a dry run: this machine has no GPUs)."""
    plan = tmp_path / "plan.json"
    r = cli("plan", "--engine", "v100plan", "--model", demo_model, "--context", "2K", "--json", "--out", plan)
    assert r.exit_code == 0, r.stderr
    launch = json.loads(plan.read_text())["launch"]
    r = _deploy(cli, server, port, demo_model, "--plan", plan, "--dry-run")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["settings"]["device"] == "cuda" and doc["settings"]["dtype"] == launch["dtype"]
    assert doc["settings"]["max_context"] == launch["max_context"]
    tp2 = next(s for s in json.loads(plan.read_text())["strategies"] if s["name"] == "tp2")
    assert doc["settings"]["allreduce"] == tp2["allreduce_path"]
    assert f"settings from {plan}" in sshd_mod.flat(r.stderr)
    if launch["strategy"] != "tp2":
        assert f"the plan recommends {launch['strategy']}" in sshd_mod.flat(r.stderr)


def test_logs_follow_streams_and_leaves_nothing_behind(env, first, server):
    from v100plan.remote import deploy as dp
    from v100plan.remote.connect import SshOptions
    from v100plan.remote.host import RemoteSettings
    from v100plan.remote.hosts import parse_host

    target = dp.Target(parse_host(server.host_spec),
                       SshOptions(known_hosts=str(server.known_hosts), identity=str(server.user_key)),
                       RemoteSettings(root=str(first["root"]), python=sshd_mod.remote_python()), DEP)
    got: list[str] = []

    class Enough(Exception):
        pass

    def on_line(line: str) -> None:
        got.append(line)
        if len(got) >= 3:
            raise Enough  # what Ctrl-C does to `logs --follow`

    with pytest.raises(Enough):
        dp.follow_logs(target, on_line, lines=5)
    assert any("serve.stderr.log" in line for line in got)
    run_dir = str(first["root"] / DEP / "run")

    def tails() -> list[int]:
        out = []
        for p in Path("/proc").iterdir():
            try:
                if p.name.isdigit() and run_dir in (p / "cmdline").read_bytes().decode(errors="replace") \
                        and b"tail" in (p / "cmdline").read_bytes():
                    out.append(int(p.name))
            except OSError:
                pass
        return out

    deadline = time.monotonic() + 10
    while tails() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert tails() == [], "the remote `tail -F` outlived the follow"


def test_qualify_refuses_a_deployment_that_deploy_made(cli, env, first, server, demo_model, tmp_path):
    """qualify stops what it deploys: pointed at the operator's deployment it must neither redeploy
    nor stop it (deploy and stop both refuse), and the service keeps running."""
    before = cli.json("status", server.host_spec, "--deployment", DEP)
    r = cli("qualify", "--host", server.host_spec, "--deployment", DEP, "--model", demo_model,
            "--port", sshd_mod.free_port(), "--out", tmp_path / "report")
    assert r.exit_code == 2, r.stderr
    assert "was made by `v100plan deploy`" in sshd_mod.flat(r.stderr)
    doc = json.loads((tmp_path / "report" / "report.json").read_text())
    assert doc["partial"] and [p["status"] for p in doc["phases"] if p["name"] in ("deploy", "stop")] == \
        ["error", "error"]
    after = cli.json("status", server.host_spec, "--deployment", DEP)
    assert after["state"] == "healthy" and after["release"] == before["release"]
    assert after["supervisord_pid"] == before["supervisord_pid"]


def test_logs_then_stop(cli, env, first, server):
    r = cli("logs", server.host_spec, "--deployment", DEP, "--json")
    assert r.exit_code == 0, r.stderr
    logs = json.loads(r.stdout)["logs"]
    assert any(logs.values())
    assert {"logs/serve.stderr.log", "service.log", "logs/supervisord.log", "front.log"} <= set(logs), logs.keys()
    assert any(re.fullmatch(r"logs/rank0\.g\d+\.log", k) and v for k, v in logs.items()), logs.keys()
    assert any(re.fullmatch(r"logs/rank1\.g\d+\.log", k) and v for k, v in logs.items()), logs.keys()
    shown = [tuple(v) for v in logs.values() if v]
    assert len(shown) == len(set(shown)), "two logs shown with the same lines"
    st = cli.json("status", server.host_spec, "--deployment", DEP)
    pids = [st["supervisord_pid"], st["proxy_pid"], *st["ranks"]]
    r = cli("stop", server.host_spec, "--deployment", DEP, "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["had_to_kill"] == []
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] == "Z"
    assert cli.json("status", server.host_spec, "--deployment", DEP)["state"] == "stopped"


def test_a_torch_without_v100_kernels_stops_the_deploy():
    """Two recordings combined: the torch build measured on the lent H200 (2.11.0+cu130, whose arch
    list starts at sm_75) judged, with the probe's own rule, against the V100 pair of the field
    recording (compute capability 7.0). The deploy must stop and name the CUDA 12.x fix."""
    from tests.remote_support import v100_pair_with_h200_torch
    from v100plan.remote.deploy import torch_gap
    from v100plan.remote.release import settings_from_probe

    v100, h200 = v100_pair_with_h200_torch()
    problem = torch_gap(v100, "ops@v100-box")
    assert problem is not None and problem.exit_code == 4
    assert "torch 2.11.0+cu130" in problem.message and "sm_70" in problem.message
    assert "CUDA 12.x" in problem.hint and "cu126" in problem.hint
    assert torch_gap(h200, "ops@h200") is None  # the same torch on the card it was measured on

    settings, why = settings_from_probe(v100, "ops@v100-box", 8000, False, None)
    assert settings.device == "cuda" and settings.dtype == "float16" and "7.0" in why


def test_qualify_host_deploys_accepts_and_stops_its_own_deployment(cli, env, server, demo_model, tmp_path):
    """`qualify --host`, the main job against a host: probe it over SSH, deploy the engine there as
    qualify's own deployment, run every scenario through the SSH forward (each fault once, a small
    load), write the three reports here, stop the deployment. One run: about 1.5 minutes here."""
    from tests.accept_support import assert_no_secret, run_cli

    dep, out = f"qualify-{os.getpid()}", tmp_path / "report"
    r = run_cli("qualify", "--host", server.host_spec, "--deployment", dep, "--port", sshd_mod.free_port(),
                "--model", demo_model, "--repeats", "1", "--requests", "16", "--clients", "4", "--out", out,
                timeout_s=900)
    assert r.returncode == 0, r.stderr[-4000:]
    doc = json.loads((out / "report.json").read_text())
    assert doc["verdict"] == "passed" and not doc["partial"]
    # the demo deploy serves has no MTP layer and no vision tower: the two speculation scenarios are
    # waived naming the flag, and image_input saying there is no tower; on CPU it decodes one request at a time,
    # so there is no batch for concurrent_equals_solo to compare
    assert doc["summary"] == {"passed": 25, "warned": 0, "failed": 0, "waived": 4, "error": 0}
    waived = {s["key"]: s["reason"] for s in doc["scenarios"] if s["status"] == "waived"}
    assert "no vision tower" in waived.pop("image_input")
    assert "one request at a time (bound cpu" in waived.pop("concurrent_equals_solo")
    assert len(waived) == 2 and all("--speculative mtp" in why for why in waived.values()), waived
    assert [p["name"] for p in doc["phases"]] == ["probe", "plan", "deploy", "accept", "stop", "report"]
    assert all(p["status"] in ("passed", "waived") for p in doc["phases"]), doc["phases"]
    # the probe section is the host's, measured there by the bundle (no checkout there: no git revision)
    probe = doc["probe"]
    assert probe["kind"] == "probe_report" and probe["overall"] == "nothing_measured"
    assert probe["provenance"]["git_revision"] is None
    assert f"no NVIDIA GPU measured on {server.host_spec}" in doc["phases"][0]["detail"]
    t = doc["target"]
    assert t["mode"] == "host" and t["host"] == server.host_spec and t["fault_control"] is True
    assert t["engine"]["devices"] == ["cpu", "cpu"]
    assert any(f"its own deployment {dep!r}" in n for n in t["notes"])
    # rank logs came over SFTP: the suite read them, and they are kept next to the report
    assert next(s for s in doc["scenarios"] if s["key"] == "rank_logs_agree")["status"] == "passed"
    logs = {p.name for p in (out / "logs").iterdir()}
    assert {"rank0.g1.log", "rank1.g1.log", "service.log", "supervisord.log"} <= logs
    # stopped afterwards: the supervisor and every process it recorded are gone
    d = env / dep
    assert json.loads((d / "history.json").read_text())[-1]["why"] == "qualify"
    stop = next(p for p in doc["phases"] if p["name"] == "stop")
    pids = dict(re.findall(r"(supervisord|proxy|rank\d) (\d+)", stop["detail"]))
    assert set(pids) == {"supervisord", "proxy", "rank0", "rank1"}, stop
    for pid in pids.values():
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] == "Z"
    assert cli.json("status", server.host_spec, "--deployment", dep)["state"] == "stopped"
    key = (d / "api_key").read_text().strip()
    assert key not in r.stdout + r.stderr
    assert_no_secret(out, key)


def test_qualify_host_ctrl_c_still_stops_its_deployment(cli, env, server, demo_model, tmp_path):
    """Ctrl-C once the engine is deployed: exit 130, a partial report, and the deployment stopped."""
    import signal

    from tests.accept_support import PLANTED_ENV, REPO

    dep, out = f"qualify-{os.getpid()}", tmp_path / "report"
    proc = subprocess.Popen([sys.executable, "-m", "v100plan", "qualify", "--host", server.host_spec, "--deployment",
                             dep, "--port", str(sshd_mod.free_port()), "--model", str(demo_model), "--out", str(out)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **PLANTED_ENV})
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("== accept"):
            break
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    _, rest = proc.communicate(timeout=300)
    assert proc.returncode == 130, "".join(seen)[-2000:] + rest[-2000:]
    doc = json.loads((out / "report.json").read_text())
    assert doc["partial"] and doc["verdict"] == "incomplete" and "Ctrl-C" in doc["partial_reason"]
    phases = {p["name"]: p["status"] for p in doc["phases"]}
    assert phases["deploy"] == "passed" and phases["stop"] == "passed", doc["phases"]
    assert cli.json("status", server.host_spec, "--deployment", dep)["state"] == "stopped"
