"""`v100plan probe --host/--inventory` against real sshd instances on 127.0.0.1 (one per fake host).

This machine has no GPU: every GPU case is waived on the hosts, and the report says so (exit 3,
nothing measured) instead of passing. What is tested here is the remote part: the bundle and venv
made once and reused, reports keyed by host, one host down never stopping the others, and a
32-host fleet probed in parallel.
"""

from __future__ import annotations

import itertools
import json
import os
import time

import pytest

from tests import sshd as sshd_mod
from tests.paths import FIXTURES

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sshd_mod.available() is not None, reason=str(sshd_mod.available()))]

FLEET = 32


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    base = tmp_path_factory.mktemp("sshd-fleet")
    first = sshd_mod.make_sshd(base / "h00").start()
    servers = [first]
    try:
        for i in range(1, FLEET):
            servers.append(sshd_mod.make_sshd(base / f"h{i:02d}", user_key=first.user_key).start())
        known = base / "known_hosts"
        known.write_text("".join(s.known_hosts_line() for s in servers))
        yield servers, known
    finally:
        for s in servers:
            s.stop()


@pytest.fixture
def env(monkeypatch, fleet, tmp_path_factory):
    servers, known = fleet
    root = sshd_mod.shared_remote_root(tmp_path_factory)
    sshd_mod.remote_env(monkeypatch, servers[0], root, known_hosts=known)
    return root


def test_one_host_probe_waives_gpu_cases_and_reuses_the_bundle(cli, env, fleet):
    servers, _ = fleet
    r = cli("probe", "--quick", "--json", "--host", servers[0].host_spec)
    assert r.exit_code == 3, r.stderr  # nothing measured: said so, never "passed"
    report = json.loads(r.stdout)
    assert report["kind"] == "probe_report" and report["overall"] == "nothing_measured"
    assert report["cases"] and all(c["status"] == "waived" and c["reason"] for c in report["cases"])
    assert "nothing could be measured" in sshd_mod.flat(r.stderr)
    bundles = sorted(p.name for p in (env / "bundles").iterdir())
    # again: the warm path is one SSH command, nothing uploaded or unpacked
    r2 = cli("probe", "--quick", "--json", "--host", servers[0].host_spec)
    assert r2.exit_code == 3
    assert "uploading" not in r2.stderr and "building the venv" not in r2.stderr
    assert sorted(p.name for p in (env / "bundles").iterdir()) == bundles


def test_fleet_with_one_host_down(cli, env, fleet, tmp_path):
    servers, _ = fleet
    down = f"{servers[0].user}@127.0.0.1:{sshd_mod.free_port()}"
    inv = tmp_path / "hosts"
    inv.write_text(f"{servers[1].host_spec}\n{down}   # powered off\n{servers[2].host_spec}\n")
    r = cli("probe", "--quick", "--json", "--inventory", inv, "--connect-timeout", "3")
    assert r.exit_code == 4, r.stderr  # one host could not be probed and --max-fail is 0
    doc = json.loads(r.stdout)
    assert list(doc["hosts"]) == [servers[1].host_spec, down, servers[2].host_spec]
    assert doc["hosts"][servers[1].host_spec]["ok"] and doc["hosts"][servers[2].host_spec]["ok"]
    assert doc["hosts"][servers[1].host_spec]["report"]["overall"] == "nothing_measured"
    assert not doc["hosts"][down]["ok"] and "cannot open an SSH session" in doc["hosts"][down]["error"]
    assert doc["summary"]["failed"] == [down]
    from v100plan import documents

    documents.validate(doc, "fleet_probe")  # kind, schema_version, provenance, as every document has
    assert doc["kind"] == "fleet_probe" and doc["provenance"]["inputs"]["inventory"] == str(inv)
    assert doc["provenance"]["inputs"]["hosts"] == list(doc["hosts"])
    err = sshd_mod.flat(r.stderr)
    assert "1 host(s) could not be probed" in err and "down" in err  # the fleet table's row

    r = cli("probe", "--quick", "--json", "--inventory", inv, "--connect-timeout", "3", "--max-fail", "1")
    assert r.exit_code == 3, r.stderr  # the down host is tolerated; the others measured nothing (no GPU)


def test_32_host_fleet_runs_in_parallel(env, fleet):
    """All 32 hosts are in flight at once, and the fleet stays within what this machine's cores allow.

    The issue asks for under twice one host's time. That holds where the fleet's work is waiting
    (a real probe loads each GPU for 15-30 s; network round trips); here all 32 fake hosts' sshd,
    login shells and probe interpreters share this machine's cores, so the bound applied is one
    host's time times 32 / cores, doubled: exactly "under twice one host" on 32 or more cores
    (docs/deploy.md has both figures measured).
    """
    from v100plan.remote.connect import SshOptions
    from v100plan.remote.host import RemoteSettings
    from v100plan.remote.hosts import parse_host
    from v100plan.remote.probe import probe_fleet

    servers, known = fleet
    ssh = SshOptions(known_hosts=str(known), identity=str(servers[0].user_key))
    rs = RemoteSettings(root=str(env), python=sshd_mod.remote_python())
    specs = [parse_host(s.host_spec) for s in servers]
    probe_fleet(specs[:1], ssh, rs, ["--quick"])  # warm: bundle and venv on the (shared) host root
    one = sorted(probe_fleet(specs[:1], ssh, rs, ["--quick"])[0].wall_s for _ in range(3))[1]  # median of 3
    t0 = time.monotonic()
    results = probe_fleet(specs, ssh, rs, ["--quick"])
    wall = time.monotonic() - t0
    assert [r.host for r in results] == [s.label for s in specs]
    assert all(r.report is not None for r in results), [r.error for r in results if r.error]
    # in flight together: the most hosts whose [started, ended] overlap (one at a time would give 1). Not "all 32
    # at once": on a busy 2-core machine the first host can end before the last one's thread is scheduled.
    events = sorted([(r.started_s, 1) for r in results] + [(r.ended_s, -1) for r in results])
    together = max(itertools.accumulate(d for _, d in events))
    assert together >= FLEET // 2, f"at most {together} of {FLEET} hosts were in flight together"
    cores = len(os.sched_getaffinity(0))
    bound = 2 * one * max(1.0, FLEET / cores)
    print(f"one host {one:.2f} s, {FLEET} hosts {wall:.2f} s, {cores} cores, bound {bound:.2f} s")
    assert wall < bound


def test_fleet_table_judges_recorded_gpu_hosts():
    """The fleet summary over real recordings (a two-H200 host, a one-H200 host) and one failed host:
    each column carries that host's verdict, the failed host its error."""

    from v100plan import output
    from v100plan.commands.probe_remote import SUMMARY_CHECKS, _judged, summary_rows
    from v100plan.remote.probe import HostResult

    fixtures = FIXTURES / "probes"
    results, judged = [], {}
    for host, name in (("a@h200x2", "h200x2-probe-quick.json"), ("b@h200", "h200-probe-quick.json")):
        report, judged[host] = _judged(json.loads((fixtures / name).read_text()))
        results.append(HostResult(host=host, report=report, wall_s=31.0))
    results.append(HostResult(host="c@down", error="c@down: cannot open an SSH session", exit_code=4))
    rows = summary_rows(results, judged)
    assert [r[0] for r in rows] == ["a@h200x2", "b@h200", "c@down"]
    a, b, c = rows
    assert a[2] == 2 and b[2] == 1
    col = {h: i + 3 for i, (h, _) in enumerate(SUMMARY_CHECKS)}
    assert a[col["variant"]] == b[col["variant"]] == "h200"
    assert a[col["read bandwidth"]] == "passed 93%" and b[col["read bandwidth"]] == "passed 95%"
    assert a[col["P2P"]] == "passed" and b[col["P2P"]] == "waived"  # one card: no pair
    assert a[col["throttle"]] == "warned" and a[col["kernels"]] == "passed"
    assert c[1] == "down" and c[-1] == "c@down: cannot open an SSH session"
    text = output.render_to_text(output.table("Fleet", ["host", "status", "cards", *(h for h, _ in SUMMARY_CHECKS),
                                                        "s", "error"], rows))
    assert "a@h200x2" in text and "passed 93%" in text
