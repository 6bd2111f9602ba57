"""`v100plan probe` and `v100plan bench probes` through the real CLI, on recorded reports."""

from __future__ import annotations

import json

import pytest

from tests.conftest import FIXTURES, gpu_available
from v100plan import documents

PROBES = FIXTURES / "probes"


def test_probe_from_recorded_h200_passes_with_warnings(cli, tmp_path):
    out = tmp_path / "judged.json"
    r = cli("probe", "--from", PROBES / "h200-probe-quick.json", "--json", "--out", out)
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    documents.validate(doc, "probe_report")
    assert doc["cards"][0]["variant_id"] == "h200"
    assert {v["check"] for v in doc["verdicts"]} >= {"variant", "read bandwidth", "throttle", "NCCL kernels"}
    assert json.loads(out.read_text()) == doc
    assert "Verdicts" in r.stderr  # the table goes to stderr under --json


def test_probe_exit_1_when_p2p_is_broken(cli):
    r = cli("probe", "--from", PROBES / "facts-pg500-216-pair-broken-p2p.json")
    assert r.exit_code == 1
    assert "P2P" in r.stdout and "Error: 2 check(s) failed" in r.stderr


def test_probe_exit_3_when_nothing_was_measured(cli, tmp_path):
    report = json.loads((PROBES / "h200-probe-quick.json").read_text())
    report["cards"], report["overall"] = [], "nothing_measured"
    report["host"]["gpu_count"] = None
    report["host"]["unavailable"]["gpu_count"] = "no NVIDIA driver reachable: NVML could not start"
    for c in report["cases"]:
        c["status"], c["reason"] = "waived", "no NVIDIA driver reachable: NVML could not start"
    path = tmp_path / "none.json"
    path.write_text(json.dumps(report))
    r = cli("probe", "--from", path)
    assert r.exit_code == 3
    assert "nothing could be measured: no NVIDIA driver" in r.stderr


def test_probe_on_this_gpu_less_machine_says_so_and_exits_3(cli):
    if gpu_available():
        pytest.skip("a GPU host: tests/probes/test_probe_gpu.py covers it")
    r = cli("probe", "--quick", "--quiet")
    assert r.exit_code == 3
    assert "nothing could be measured: no NVIDIA driver reachable" in r.stderr


def test_probe_rejects_bad_options(cli):
    assert cli("probe", "--quick", "--soak", "60").exit_code == 2
    assert cli("probe", "--duration", "-1").exit_code == 2
    r = cli("probe", "--from", PROBES / "missing.json")
    assert r.exit_code == 2 and "file not found" in r.stderr


def test_bench_probes_reports_ratio_and_phases(cli):
    doc = cli.json("bench", "probes", "--from", PROBES / "h200-probe-quick.json")
    row = doc["bandwidth"][0]
    assert row["read_over_best_reference"] >= 0.98 and row["meets_target"]
    assert row["read_bw_gbps"] == 4585.0 and row["best_reference"] == "torch_sum_gbps"
    assert [p["case"] for p in doc["phases"]] == ["inventory", "software_stack", "bandwidth", "p2p", "cuda_ipc",
                                                  "throttle"]


def test_unknown_case_key_is_bad_input(cli):
    r = cli("probe", "--only", "bandwith")
    assert r.exit_code == 2 and "unknown case key" in r.stderr and "bandwidth" in r.stderr
