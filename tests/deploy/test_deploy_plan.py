"""`v100plan deploy` runs what the plan chose: dtype, context, K/V cache type, MTP speculation and its draft tokens
and the allreduce path from --plan FILE, each overridable by a flag; --dry-run prints the exact serve command; and
`status` shows the settings the service runs with and where they came from. Against the tests' real sshd on
127.0.0.1: a plan for the 27B hybrid (GPTQ, multimodal layout) on two V100s as a dry run (no GPU here), and a
real deploy of the MTP demo model on CPU with settings given by flag."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import sshd as sshd_mod
from tests.deploy_support import *  # noqa: F403 - the shared fixtures
from tests.paths import REPO

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sshd_mod.available() is not None, reason=str(sshd_mod.available()))]

DEP = f"plan-{os.getpid()}"
CONFIG_27B = REPO / "tests/fixtures/planner/qwen3.5-27b-gptq-multimodal.config.json"


def _deploy(cli, server, port, model, *extra):
    return cli("deploy", server.host_spec, "--model", model, "--deployment", DEP, "--port", port,
               "--health-timeout", "120", *extra)


@pytest.fixture(scope="module")
def plan_27b(tmp_path_factory):
    from tests.conftest import Cli

    out = tmp_path_factory.mktemp("plan") / "plan.json"
    r = Cli()("plan", "--hardware", "v100-sxm2-32gb", "--gpus", "2", "--model", CONFIG_27B, "--kv-cache-dtype",
              "int8", "--workload", "code", "--json", "--out", out)
    assert r.exit_code == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("models") / "hybrid-mtp"
    subprocess.run([sys.executable, "-m", "engine", "make-demo-model", str(d), "--arch", "qwen3_5", "--mtp"],
                   check=True, capture_output=True, timeout=300)
    (d / "README.md").write_text(f"the MTP demo of {__name__}, run {os.getpid()}\n")
    return d


def test_dry_run_prints_the_plans_serve_command(cli, env, server, port, mtp_model, plan_27b):
    launch = json.loads(plan_27b.read_text())["launch"]
    assert launch["speculative"] == "mtp" and launch["kv_cache_dtype"] == "int8" and launch["acceptance"] == 0.745
    r = _deploy(cli, server, port, mtp_model, "--plan", plan_27b, "--dry-run", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    cmd = doc["serve_command"]
    line = " ".join(cmd)
    assert cmd[1:4] == ["-m", "engine", "serve"] and cmd[0].endswith("/venv/bin/python")
    for flags in (["--dtype", "float16"], ["--kv-cache-dtype", "int8"], ["--speculative", "mtp"],
                  ["--draft-tokens", str(launch["draft_tokens"])], ["--max-context", str(launch["max_context"])],
                  ["--device", "cuda"], ["--allreduce", launch["allreduce"]], ["--max-concurrency", "1"]):
        assert " ".join(flags) in line, (flags, line)
    assert "--port <SLOT_PORT>" in line and "<SLOT_DIR>/service.log" in line  # what only the host picks
    assert doc["settings"]["kv_cache_dtype"] == "int8" and doc["settings"]["draft_tokens"] == launch["draft_tokens"]
    assert doc["settings"]["max_concurrency"] == launch["concurrency"] == 1  # the sequences the plan priced
    assert "would serve: " in sshd_mod.flat(r.stderr)
    # a flag wins over the plan, and says so
    r = _deploy(cli, server, port, mtp_model, "--plan", plan_27b, "--dry-run", "--speculative", "off",
                "--kv-cache-dtype", "auto", "--max-context", "65536", "--max-concurrency", "memory")
    assert r.exit_code == 0, r.stderr
    out = sshd_mod.flat(r.stdout + r.stderr)
    served = out.split("would serve: ")[1].split("\n")[0]
    assert "--speculative" not in served and "--max-concurrency" not in served  # serve's own default
    assert "given: --max-context 65536, --kv-cache-dtype auto, --speculative off, --max-concurrency memory" in out
    assert "the engine's default (/health will say it)" in out  # the dry run's max concurrency row
    # N > 1 with the plan's MTP speculation is served (a speculation round per slot); past 64, refused before upload
    r = _deploy(cli, server, port, mtp_model, "--plan", plan_27b, "--dry-run", "--max-concurrency", "4")
    assert r.exit_code == 0, r.stderr
    served = sshd_mod.flat(r.stdout + r.stderr).split("would serve: ")[1].split("\n")[0]
    assert "--max-concurrency 4" in served and "--speculative mtp" in served, served
    r = _deploy(cli, server, port, mtp_model, "--plan", plan_27b, "--dry-run", "--max-concurrency", "65")
    assert r.exit_code == 2 and "65" in sshd_mod.flat(r.stderr) and "Traceback" not in r.stderr


def test_bad_settings_are_refused_before_connecting(cli, env, server, port, demo_model, plan_27b):
    r = _deploy(cli, server, port, demo_model, "--kv-cache-dtype", "fp8", "--dry-run")
    assert r.exit_code == 2 and "--kv-cache-dtype 'fp8'" in r.stderr and "Traceback" not in r.stderr
    r = _deploy(cli, server, port, demo_model, "--draft-tokens", "9", "--dry-run")
    assert r.exit_code == 2 and "--draft-tokens 9" in r.stderr
    # the plan speculates, the dense demo has no MTP layer: said before anything is uploaded
    r = _deploy(cli, server, port, demo_model, "--plan", plan_27b, "--dry-run")
    assert r.exit_code == 2 and "declares no MTP layer" in r.stderr and "--speculative off" in r.stderr


def test_deploy_runs_the_settings_and_status_shows_them(cli, env, server, port, mtp_model):
    r = _deploy(cli, server, port, mtp_model, "--kv-cache-dtype", "int8", "--draft-tokens", "2", "--json")
    assert r.exit_code == 0, r.stderr
    try:
        st = cli.json("status", server.host_spec, "--deployment", DEP)
        assert st["state"] == "healthy", st
        assert st["engine"]["kv_cache_dtype"] == "int8" and st["engine"]["draft_tokens"] == 2
        assert st["origin"]["chosen_by"].startswith("probe of") and st["origin"]["given"] == {
            "kv_cache_dtype": "int8", "draft_tokens": 2}
        # what the service itself says it runs: the ranks' context (native on CPU) and speculation on
        assert st["health"]["context"]["bound"] == "native" and st["health"]["context"]["max_context"] == 4096
        assert st["health"]["speculation"]["draft_tokens"] == 2
        # no --max-concurrency on CPU with MTP: one request at a time, and the bound says why
        assert st["health"]["concurrency"]["max_concurrency"] == 1 and st["health"]["concurrency"]["bound"] == "mtp"
        r = cli("status", server.host_spec, "--deployment", DEP)
        text = sshd_mod.flat(r.stdout.replace("│", " "))  # a cell wrapped onto the table's next line reads on
        assert "context 4096 (native)" in text and "K/V int8" in text and "MTP 2 draft tokens" in text
        assert "1 at once (mtp)" in text
        assert "flags: kv_cache_dtype int8, draft_tokens 2" in text
    finally:
        cli("stop", server.host_spec, "--deployment", DEP)
