"""The control plane's judgement: naming the variant from PCI ids and judging figures against it,
on the recorded H200 and on the docs/field-figures.md situations (built only from docs/field-figures.md numbers)."""

from __future__ import annotations

import copy
import json

import pytest

from tests.conftest import FIXTURES
from v100plan import catalogue, probe_judge

PROBES = FIXTURES / "probes"


def _load(name):
    return json.loads((PROBES / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def hardware():
    return catalogue.all_of("hardware")


def _rows(j, subject=None, check=None):
    return [r for r in j.rows if (subject is None or r.subject == subject) and (check is None or r.check == check)]


def test_two_v100_32g_are_told_apart_by_pci_id(hardware):
    pg = _load("facts-pg500-216-pair-broken-p2p")["cards"][0]
    sx = _load("facts-sxm2-pair-nvlink-hot-card1")["cards"][0]
    assert probe_judge.identify(pg, hardware)[0]["id"] == "v100-pg500-216"
    assert probe_judge.identify(sx, hardware)[0]["id"] == "v100-sxm2-32gb"


def test_recorded_h200_is_identified_and_judged(hardware):
    j = probe_judge.judge(_load("h200-probe-quick"), hardware)
    assert j.report["cards"][0]["variant_id"] == "h200"
    assert "variant_id" not in j.report["cards"][0]["unavailable"]
    assert _rows(j, "card 0", "read bandwidth")[0].status == "passed"
    throttle = _rows(j, "card 0", "throttle")[0]
    assert throttle.status == "warned" and "power capped, not heat" in throttle.detail
    assert _rows(j, "pairs", "P2P")[0].status == "waived"
    assert j.worst == "warned"


def test_pg500_pair_with_broken_p2p_fails_on_the_pairs_only(hardware):
    j = probe_judge.judge(_load("facts-pg500-216-pair-broken-p2p"), hardware)
    p2p = _rows(j, check="P2P")
    assert [r.subject for r in p2p] == ["pair 0->1", "pair 1->0"]
    assert all(r.status == "failed" and "49000 us vs 16 us" in r.detail for r in p2p)
    # 1058 of the 1133 GB/s that 1107 MHz implies: the fast HBM is there.
    assert all(r.status == "passed" for r in _rows(j, check="read bandwidth"))
    assert j.worst == "failed"


def test_sxm2_pair_has_nvlink_and_a_thermally_limited_card_1(hardware):
    j = probe_judge.judge(_load("facts-sxm2-pair-nvlink-hot-card1"), hardware)
    assert _rows(j, "card 1", "throttle")[0].status == "failed"
    assert _rows(j, "card 0", "throttle")[0].status == "passed"
    assert all(r.status == "passed" and "6 NVLink links" in r.detail for r in _rows(j, check="P2P"))
    assert [c["variant_id"] for c in j.report["cards"]] == ["v100-sxm2-32gb", "v100-sxm2-32gb"]


def test_os_nccl_without_sm70_fails_a_two_card_v100_box(hardware):
    """docs/field-figures.md: the OS-packaged NCCL 2.31 has no sm_70 kernels; on two cards that is a failure."""
    report = _load("facts-sxm2-pair-nvlink-hot-card1")
    report["host"]["nccl_version"] = "2.31"
    for card in report["cards"]:
        card["nccl_supported"] = False
    rows = _rows(probe_judge.judge(report, hardware), check="NCCL kernels")
    assert [r.status for r in rows] == ["failed", "failed"] and "sm_70" in rows[0].detail
    one = copy.deepcopy(report)
    one["cards"], one["pairs"] = one["cards"][:1], []
    assert _rows(probe_judge.judge(one, hardware), check="NCCL kernels")[0].status == "warned"


def test_unknown_pci_id_gets_generic_expectations_and_a_warning(hardware):
    report = _load("h200-probe-quick")
    report["cards"][0]["pci_device_id"] = "10de:ffff"
    j = probe_judge.judge(report, hardware)
    variant = _rows(j, "card 0", "variant")[0]
    assert variant.status == "warned" and "10de:ffff is not in the catalogue" in variant.detail
    assert j.report["cards"][0]["variant_id"] is None
    assert "generic" in j.report["cards"][0]["unavailable"]["variant_id"]
    # Still judged, against its own clock x bus: never a silent skip.
    assert _rows(j, "card 0", "read bandwidth")[0].status == "passed"


def test_a_card_whose_memory_clock_differs_from_its_profile_is_flagged(hardware):
    report = _load("facts-sxm2-pair-nvlink-hot-card1")
    report["cards"][0]["mem_clock_max_mhz"] = 1107  # a PG500's clock on an SXM2 id
    row = _rows(probe_judge.judge(report, hardware), "card 0", "memory clock")[0]
    assert row.status == "warned" and "877" in row.detail


def test_low_bandwidth_fails(hardware):
    report = _load("facts-sxm2-pair-nvlink-hot-card1")
    report["cards"][0]["read_bw_gbps"] = 500.0  # 56 % of 898
    assert _rows(probe_judge.judge(report, hardware), "card 0", "read bandwidth")[0].status == "failed"


def test_shared_pci_id_is_resolved_by_memory_size():
    profiles = [{"id": "small", "pci_device_ids": ["10de:1111"], "memory_gib": 16, "mem_clock_max_mhz": 877},
                {"id": "big", "pci_device_ids": ["10de:1111"], "memory_gib": 32, "mem_clock_max_mhz": 877}]
    card = {"pci_device_id": "10de:1111", "memory_total_gib": 31.7, "mem_clock_max_mhz": 877}
    assert probe_judge.identify(card, profiles)[0]["id"] == "big"
