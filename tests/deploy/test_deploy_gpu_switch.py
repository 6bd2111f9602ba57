"""`--switch auto` on a GPU host decides from the cards' free memory, against a real sshd on 127.0.0.1.

The host's nvidia-smi is a fake first on the remote PATH (sshd's SetEnv): a script that prints what a
real H200 pair printed for `nvidia-smi --query-gpu=index,memory.used,memory.total,memory.free
--format=csv,noheader,nounits`, with the figures of this repository's H200 recordings:
143771 MiB per card (tests/fixtures/acceptance/qualify-h200x2-bf16-2026-11-30.txt, `memory.total`) and,
for the full cards, 139743 MiB in use (tests/fixtures/engine/h200-long-context-27b-256k-2026-12-02.json,
`gpu_memory_used_mib.max`: the 27B served at 256K). The ranks themselves run on CPU (CI has no GPU): what
is tested is the decision and what each decision does to the serving port.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from tests import sshd as sshd_mod
from tests.deploy_support import *  # noqa: F403 - the shared fixtures
from tests.deploy_support import HealthPoller, live_slot, module_env

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sshd_mod.available() is not None, reason=str(sshd_mod.available()))]

DEP = f"gpuswitch-{os.getpid()}"
TOTAL_MIB = 143771     # an H200's memory.total, recorded (module docstring)
FULL_USED_MIB = 139743  # memory.used while the 27B served 256K, recorded (module docstring)
ROOMY = "".join(f"{i}, 0, {TOTAL_MIB}, {TOTAL_MIB}\n" for i in (0, 1))
FULL = "".join(f"{i}, {FULL_USED_MIB}, {TOTAL_MIB}, {TOTAL_MIB - FULL_USED_MIB}\n" for i in (0, 1))


@pytest.fixture(scope="module")
def fake_bin(tmp_path_factory):
    d = tmp_path_factory.mktemp("fake-gpu-bin")
    (d / "nvidia-smi").write_text('#!/bin/sh\n# a recorded H200 pair (tests/deploy/test_deploy_gpu_switch.py)\n'
                                  'cat "$(dirname "$0")/recording.csv"\n')
    (d / "nvidia-smi").chmod(0o755)
    (d / "recording.csv").write_text(ROOMY)
    return d


@pytest.fixture(scope="module")
def server(tmp_path_factory, fake_bin):  # the shared one, with the fake nvidia-smi first on its PATH
    s = sshd_mod.make_sshd(tmp_path_factory.mktemp("sshd-gpu-switch"))
    s.extra_config = f"SetEnv PATH={fake_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
    s.start()
    yield s
    s.stop()


def _deploy(cli, server, port, model, *extra):
    return cli("deploy", server.host_spec, "--model", model, "--deployment", DEP, "--port", port,
               "--health-timeout", "120", *extra)


@pytest.fixture(scope="module")
def first(tmp_path_factory, server, port, demo_model, bundle_snapshot, local_home, fake_bin):
    from tests.conftest import Cli

    with module_env(server, tmp_path_factory, bundle_snapshot, local_home) as root:
        r = _deploy(Cli(), server, port, demo_model, "--json")
        assert r.exit_code == 0, r.stderr
        yield {"dir": root / DEP, "release": json.loads(r.stdout)["release"]}
        Cli()("stop", server.host_spec, "--deployment", DEP)


def _serving(first) -> str:
    return os.readlink(first["dir"] / "current").split("/")[-1]


def test_cards_with_room_switch_blue_green_with_no_failed_poll(cli, env, first, server, port, demo_model,
                                                               fake_bin):
    (fake_bin / "recording.csv").write_text(ROOMY)
    old_slot = live_slot(first["dir"])
    with HealthPoller(port) as poll:
        r = _deploy(cli, server, port, demo_model, "--max-context", "512", "--json")
        time.sleep(0.5)
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    from v100plan import documents

    documents.validate(doc, "deploy_outcome")
    sw = doc["switch"]
    assert sw["mode"] == "blue-green" and "every card holds" in sw["why"], sw
    assert [g["index"] for g in sw["gpus"]] == [0, 1] and all(g["fits"] for g in sw["gpus"]), sw
    assert all(g["free_bytes"] == TOTAL_MIB << 20 and g["need_bytes"] > 4 << 30 for g in sw["gpus"]), sw
    assert "switch blue-green: every card holds" in sshd_mod.flat(r.stderr)
    assert poll.polls > 50 and poll.failed == 0, (poll.polls, poll.failures)
    assert live_slot(first["dir"]) != old_slot and _serving(first) == doc["release"]
    print(f"GPU host with room: blue/green, {poll.polls} polls, {poll.failed} failed; need per card "
          f"{sw['gpus'][0]['need_bytes']} B of {sw['gpus'][0]['free_bytes']} B free")


def test_blue_green_asked_where_it_cannot_fit_is_refused_before_anything_stops(cli, env, first, server, port,
                                                                               demo_model, fake_bin):
    (fake_bin / "recording.csv").write_text(FULL)
    serving = _serving(first)
    sup = int((live_slot(first["dir"]) / "supervisord.pid").read_text())
    with HealthPoller(port) as poll:
        r = _deploy(cli, server, port, demo_model, "--max-context", "256", "--switch", "blue-green")
    assert r.exit_code == 2, r.stderr
    err = sshd_mod.flat(r.stderr)
    free_gib = f"{(TOTAL_MIB - FULL_USED_MIB) / 1024:.2f} GiB free of {TOTAL_MIB / 1024:.2f} GiB"
    assert "--switch blue-green: the new release does not fit beside release " + serving in err, err
    assert "GPU 0: needs " in err and free_gib in err and "nothing was stopped" in err, err
    assert "Traceback" not in err
    assert poll.failed == 0, poll.failures
    assert _serving(first) == serving and (live_slot(first["dir"]) / "supervisord.pid").read_text() == f"{sup}\n"


def test_full_cards_fall_back_to_stop_start_with_the_outage_named(cli, env, first, server, port, demo_model,
                                                                  fake_bin):
    (fake_bin / "recording.csv").write_text(FULL)
    serving = _serving(first)
    r = _deploy(cli, server, port, demo_model, "--max-context", "256", "--dry-run")  # the plan, human output
    assert r.exit_code == 0, r.stderr
    err = sshd_mod.flat(r.stderr)
    assert "would: switch stop-start: the cards cannot hold the new release beside what is in use (GPU 0: needs" \
        in err and "an outage until the new one passes /health" in err, err
    assert f"would: stop the service of release {serving} first (the cards cannot hold" in err, err
    assert "switch" in r.stdout and "stop-start" in r.stdout, r.stdout  # the table's row
    with HealthPoller(port) as poll:
        r = _deploy(cli, server, port, demo_model, "--max-context", "256", "--json")
    assert r.exit_code == 0, r.stderr
    sw = json.loads(r.stdout)["switch"]
    assert sw["mode"] == "stop-start" and "an outage" in sw["why"], sw
    assert all(not g["fits"] and g["need_bytes"] > g["free_bytes"] == (TOTAL_MIB - FULL_USED_MIB) << 20
               for g in sw["gpus"]), sw
    assert "the service is down until" in sshd_mod.flat(r.stderr)
    assert poll.failed > 0, poll.polls  # the outage is real, and was named
    print(f"GPU host without room: stop-start, {poll.failed} of {poll.polls} polls failed")
    st = cli.json("status", server.host_spec, "--deployment", DEP)
    assert st["state"] == "healthy" and st["engine"]["max_context"] == 256


def test_rollback_measures_the_cards_against_the_release_it_goes_back_to(cli, env, first, server, port,
                                                                          fake_bin):
    from v100plan import documents

    serving = _serving(first)
    (fake_bin / "recording.csv").write_text(FULL)
    r = cli("rollback", server.host_spec, "--deployment", DEP, "--switch", "blue-green")
    assert r.exit_code == 2 and "does not fit beside release " + serving in sshd_mod.flat(r.stderr), r.stderr
    assert _serving(first) == serving
    (fake_bin / "recording.csv").write_text(ROOMY)
    with HealthPoller(port) as poll:
        r = cli("rollback", server.host_spec, "--deployment", DEP, "--json")
    assert r.exit_code == 0, r.stderr
    doc = documents.validate(json.loads(r.stdout), "rollback_outcome")
    sw = doc["switch"]
    assert sw["mode"] == "blue-green" and len(sw["gpus"]) == 2 and all(g["fits"] for g in sw["gpus"]), sw
    assert poll.failed == 0, poll.failures
    assert _serving(first) == doc["release"] != serving
