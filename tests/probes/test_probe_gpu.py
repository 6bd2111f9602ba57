"""The probes on a real GPU (marked ``gpu``: skipped in CI, run on the lent device).

One quick probe run per module; every test reads it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def quick_run():
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "probes", "--quick"], capture_output=True, text=True, timeout=300,
                       cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    wall = time.perf_counter() - t0
    assert r.stdout, r.stderr[-2000:]
    return r.returncode, json.loads(r.stdout), wall


def test_quick_mode_finishes_under_a_minute_and_validates(quick_run):
    from v100plan import documents

    code, report, wall = quick_run
    documents.validate(report, "probe_report")
    assert wall < 60, f"quick probe took {wall:.1f} s"
    assert code in (0, 1), report["cases"]
    statuses = {c["key"]: c["status"] for c in report["cases"]}
    assert statuses["inventory"] in ("passed", "warned")
    assert statuses["bandwidth"] == "passed", statuses
    assert "error" not in statuses.values(), report["cases"]


def test_bandwidth_reaches_98_percent_of_best_in_run_reference(quick_run):
    card = quick_run[1]["cards"][0]
    refs = card["bandwidth"]["references_gbps"]
    assert card["read_bw_gbps"] >= 0.98 * max(refs.values()), (card["read_bw_gbps"], refs)
    # The measured figure cannot beat what the memory clock allows.
    assert card["read_bw_gbps"] < card["implied_bw_gbps"]


def test_one_card_waives_pairs_and_same_device_ipc_works(quick_run):
    report = quick_run[1]
    if len(report["cards"]) != 1:
        pytest.skip("this check is for one-card hosts")
    cases = {c["key"]: c for c in report["cases"]}
    assert cases["p2p"]["status"] == "waived" and "one card" in cases["p2p"]["reason"]
    assert cases["cuda_ipc"]["status"] == "passed", cases["cuda_ipc"]
    assert report["pairs"] == []


def test_throttle_is_named_with_its_cause(quick_run):
    card = quick_run[1]["cards"][0]
    t = card["throttle"]
    assert t["verdict"] in ("clean", "power_capped", "thermally_limited")
    assert t["sample_hz"] >= 5, t["sample_hz"]
    if t["verdict"] == "power_capped":
        assert t["share_by_reason"]["sw_power_cap"] >= 0.05
        assert "not heat" in t["explanation"]


def test_nvlink_unavailable_carries_the_reason(quick_run):
    card = quick_run[1]["cards"][0]
    if card["nvlink"] is None:
        assert "NVLink" in card["unavailable"]["nvlink"]
        assert "NotSupported" in card["unavailable"]["nvlink"] or "links" in card["unavailable"]["nvlink"]


def test_nccl_archs_read_from_the_library_match_cuobjdump(quick_run):
    host = quick_run[1]["host"]
    assert host["nccl_archs"], host["unavailable"]
    from probes import fatbin, stack

    t0 = time.perf_counter()
    parsed = fatbin.archs_in(host["nccl_library"])
    parse_s = time.perf_counter() - t0
    assert parsed == host["nccl_archs"]
    assert parse_s < 5, f"parsing the NCCL library took {parse_s:.1f} s"
    by_tool = stack.cuobjdump_archs(host["nccl_library"])
    if by_tool is None:
        pytest.skip("no cuobjdump on this host to cross-check with")
    assert set(parsed) == set(by_tool), (parsed, by_tool)


def test_pair_and_ipc_code_paths_run_on_one_card():
    """One card has no pair, but the pair measurement's code can still run card 0 -> card 0,
    so the P2P, IPC and allreduce code is exercised on a GPU before a two-card host sees it."""
    import cupy as cp
    import torch

    from probes import ipc, p2p, stack

    m = p2p.measure_pair(cp, 0, 0, runs=20)
    assert m["p2p_direct_4k_us"] > 0 and m["host_staged_4k_us"] > 0 and m["p2p_bulk_gbps"] > 100
    assert "copy_wrong" not in m
    verdict, why = p2p.verdict_of({**m, "peer_access_reported": True})
    assert verdict == "working", why  # an on-card copy is never 10x slower than staging
    ok, text = ipc.check(cp, 0, 0)
    assert ok, text
    assert stack.small_allreduce(torch, 1) == ""
