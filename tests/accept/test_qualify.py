"""`v100plan qualify`, the README's main job, run as a user runs it on a machine with no GPU: it
probes (nothing to measure), serves the generated demo model on CPU under the engine's
supervisor, runs every scenario (each fault three times, 200 requests from 16 clients) and
writes the three reports. Ctrl-C stops everything it started and still leaves a partial report."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.accept_support import PLANTED_ENV, REPO, assert_no_secret, outputs, report, run_cli, scenario

pytestmark = pytest.mark.slow

FAULTS = ("kill_rank1", "kill_rank0", "freeze_rank1", "corrupt_hash", "stall_allreduce", "kill_proxy",
          "restart_storm", "spec_fault")


def _our_processes(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker` (qualify's private state directory)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().split(") ")[-1][:1] == "Z":
                    continue
        except OSError:
            continue
        if marker in cmd:
            found.append(cmd)
    return found


@pytest.fixture(scope="module")
def qualified(tmp_path_factory):
    out = tmp_path_factory.mktemp("qualify") / "report"
    r = run_cli("qualify", "--out", out, timeout_s=1800)
    return r, out


def test_qualify_passes_with_every_fault_recovered(qualified):
    r, out = qualified
    assert r.returncode == 0, r.stderr[-4000:]
    doc = report(out)
    assert doc["verdict"] == "passed" and not doc["partial"]
    assert [p["name"] for p in doc["phases"]] == ["probe", "plan", "start", "accept", "report"]
    assert doc["phases"][0]["status"] == "waived" and "no NVIDIA GPU" in doc["phases"][0]["detail"]
    assert any("no GPU" in n for n in doc["target"]["notes"]) and doc["target"]["server"] == "v100plan engine"
    assert doc["summary"]["failed"] == 0 and doc["summary"]["error"] == 0
    # no GPU, so no plan: the comparison with the plan is empty and says why (never invented numbers)
    pvm = doc["plan_vs_measured"]
    assert pvm["figures"] == [] and pvm["why"].startswith("no GPU") and doc["plan"] is None
    # the waivers: with MTP on, the default is one request at a time (its rounds run in CUDA graphs only then), so there is no
    # batch to compare; the MTP demo has no vision tower (the demo holds one or the other)
    waived = {s["key"]: s["reason"] for s in doc["scenarios"] if s["status"] == "waived"}
    assert set(waived) == {"concurrent_equals_solo", "image_input"}, waived
    assert "one request at a time (bound mtp" in waived["concurrent_equals_solo"]
    assert "no vision tower" in waived["image_input"]
    for key in FAULTS:
        sc = scenario(doc, key)
        reps = sc["repetitions"]
        assert sc["status"] == "passed" and len(reps) == 3, sc
        for rep in reps:
            assert rep["status"] == "passed"
            assert rep["time_to_detect_s"] is not None and rep["time_to_recover_s"] >= rep["time_to_detect_s"]
        assert sc["time_to_recover_s"]["n"] == 3
    # the demo has an MTP layer and is served speculating: greedy answers equal one-token decoding's, the
    # follow-up of a conversation reuses its first turn and answers as the cold prompt
    assert doc["target"]["engine"]["speculative"] == {"method": "mtp", "draft_tokens": 3}
    spec = scenario(doc, "spec_equals_plain")
    assert spec["status"] == "passed" and spec["metrics"]["draft_tokens"] > 0, spec
    prefix = scenario(doc, "prefix_reuse")["metrics"]
    assert prefix["follow_up_cached_tokens"] >= prefix["turn_1_prompt_tokens"] - 1 and prefix["cold_cached_tokens"] == 0  # no BOS token here
    assert scenario(doc, "spec_fault")["metrics"]["drafts_after_recovery"] > 0
    load = doc["load"]
    assert load["requests"] == 200 and load["clients"] == 16 and load["served_max_concurrency"] == 1
    ends = load["outcomes"]
    assert ends.get("wrong", 0) == ends.get("lost", 0) == ends.get("duplicate", 0) == ends.get("error", 0) == 0
    assert ends.get("correct", 0) + ends.get("cancelled", 0) == 200
    assert len(load["latencies_s"]) == ends.get("correct", 0) and load["latency_s"]["p99"] >= load["latency_s"]["p50"]


def test_qualify_keeps_the_logs_and_leaves_nothing_running(qualified):
    r, out = qualified
    logs = sorted(p.name for p in (out / "logs").iterdir())
    assert "service.log" in logs and "rank0.g1.log" in logs and "rank1.g1.log" in logs
    assert "supervisord.log" in logs
    assert not any("api-key" in name for name in logs)
    assert not _our_processes("v1p-q-")


def test_qualify_reports_hold_no_secret_and_draw_every_plot(qualified):
    r, out = qualified
    assert_no_secret(out)
    html = outputs(out)["report.html"]
    for plot in ("recovery-kill_rank1", "recovery-restart_storm", "latency", "decode-speed"):
        assert f'data-plot="{plot}"' in html
    assert 'tests="29"' in outputs(out)["junit.xml"].replace("'", '"')


def test_ctrl_c_stops_everything_and_writes_a_partial_report(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.Popen([sys.executable, "-m", "v100plan", "qualify", "--out", str(out)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **PLANTED_ENV})
    seen = []
    deadline = time.monotonic() + 300
    for line in proc.stderr:
        seen.append(line)
        if "functional completion" in line or time.monotonic() > deadline:
            break
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(seen)[-2000:] + rest[-2000:]
    doc = report(out)
    assert doc["partial"] and doc["verdict"] == "incomplete" and "Ctrl-C" in doc["partial_reason"]
    assert any(p["status"] == "interrupted" for p in doc["phases"])
    assert (out / "report.html").exists() and (out / "junit.xml").exists()
    time.sleep(1)
    assert not _our_processes("v1p-q-")


@pytest.mark.parametrize("args, says", [
    (("--port", "9000"), "--port apply to --host only"),
    (("--torch", "torch==2.5.1"), "--torch apply to --host only"),
    (("--host", "ops@gpu-box", "--device", "cuda:0,cuda:1"), "give auto, cpu, cuda"),
    (("--host", "ops@gpu-box", "--port", "70000"), "--port 70000 is out of range"),
    (("--host", "ops@gpu box"), "is not user@host[:port]"),
    (("--host", "ops@gpu-box", "--deployment", "../engine"), "use letters, digits"),
    (("--host", "ops@gpu-box", "--connect-timeout", "0"), "--connect-timeout must be a positive number"),
])
def test_qualify_host_bad_input_is_refused_before_any_connection(cli, args, says):
    r = cli("qualify", *args)
    assert r.exit_code == 2, r.stderr
    assert says in " ".join(r.stderr.split()) and "Hint:" in r.stderr
