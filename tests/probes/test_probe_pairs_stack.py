"""Pure parts of the P2P and software-stack cases, on docs/field-figures.md numbers and the recorded H200 stack."""

from __future__ import annotations

import json

import pytest

from probes import p2p, report, stack
from probes.context import CardState, Options, ProbeContext
from tests.conftest import FIXTURES

H200 = json.loads((FIXTURES / "probes" / "h200-probe-quick.json").read_text())


def test_p2p_verdicts_on_field_report_numbers():
    broken = p2p.verdict_of({"peer_access_reported": True, "p2p_direct_4k_us": 49000.0, "host_staged_4k_us": 16.0})
    assert broken[0] == "broken" and "3062x slower" in broken[1]
    working = p2p.verdict_of({"peer_access_reported": True, "p2p_direct_4k_us": 3.2, "host_staged_4k_us": 16.0,
                              "p2p_bulk_gbps": 145.0})
    assert working[0] == "working" and "145.0 GB/s" in working[1]
    assert p2p.verdict_of({"peer_access_reported": False, "p2p_direct_4k_us": 30.0,
                           "host_staged_4k_us": 16.0})[0] == "unavailable"
    assert p2p.verdict_of({"peer_access_reported": True, "copy_wrong": True})[0] == "broken"


def test_nvlink_links_are_counted_per_peer():
    links = [{"link": i, "active": True, "version": 2, "remote_pci_bus_id": "00000000:3B:00.0"} for i in range(6)]
    links += [{"link": 6, "active": False, "version": 2, "remote_pci_bus_id": "00000000:3B:00.0"}]
    src = {"nvlink": {"links": links, "active_links": 6}}
    assert p2p.nvlink_links_between(src, {"pci_bus_id": "0000:3b:00.0"}) == 6
    assert p2p.nvlink_links_between(src, {"pci_bus_id": "00000000:86:00.0"}) == 0
    assert p2p.nvlink_links_between({"nvlink": None}, {"pci_bus_id": "x"}) is None


def _v100_box(n_cards: int, monkeypatch, **host_overrides) -> ProbeContext:
    """A V100 box running the software recorded on the lent H200 (its NCCL and torch start at sm_75)."""
    host = {**H200["host"], **host_overrides}
    ctx = ProbeContext(Options.for_mode("quick"))
    for i in range(n_cards):
        card = CardState(i)
        card.set("compute_capability", "7.0")
        ctx.cards.append(card)

    def fake_read_stack(c):
        for field in ("nccl_version", "nccl_archs", "nccl_library", "torch_version", "torch_arch_list",
                      "nvrtc_archs"):
            c.set_host(field, host[field])
        return {"libraries": [], "torch": None}

    monkeypatch.setattr(stack, "read_stack", fake_read_stack)
    return ctx


def test_cuda13_stack_on_two_v100s_fails_with_the_fix(monkeypatch):
    ctx = _v100_box(2, monkeypatch)
    outcome = stack.run_stack(ctx)
    assert outcome.status == "failed"
    assert "torch 2.11.0+cu130 has no kernels" in outcome.reason
    assert "NCCL 2.28.9" in outcome.reason and "sm_70" in outcome.reason
    assert [c.values["nccl_supported"] for c in ctx.cards] == [False, False]
    assert [c.values["cupy_supported"] for c in ctx.cards] == [False, False]
    assert ctx.host["stack_verdict"] == "failed" and "install" in ctx.host["stack_fix"]


def test_nccl_gap_on_one_card_is_only_a_warning(monkeypatch):
    torch_with_sm70 = ["sm_70", *H200["host"]["torch_arch_list"]]
    ctx = _v100_box(1, monkeypatch, torch_arch_list=torch_with_sm70)
    outcome = stack.run_stack(ctx)
    assert outcome.status == "warned"
    assert "NCCL" in outcome.reason and ctx.cards[0].values["torch_supported"] is True
    assert ctx.cards[0].values["nccl_supported"] is False


def test_report_round_trips_through_its_dataclasses():
    again = report.from_dict(H200).to_dict()
    assert again["cards"][0]["read_bw_gbps"] == H200["cards"][0]["read_bw_gbps"]
    assert again["cards"][0]["throttle"]["samples"] == H200["cards"][0]["throttle"]["samples"]
    assert again["host"] == H200["host"] and again["cases"] == H200["cases"]


@pytest.mark.parametrize("version_code, text", [(22105, "2.21.5"), (22809, "2.28.9"), (2708, "2.7.8")])
def test_nccl_version_codes(version_code, text, monkeypatch):
    class Lib:
        def ncclGetVersion(self, ref):
            ref._obj.value = version_code
            return 0

    monkeypatch.setattr(stack.ctypes, "CDLL", lambda path: Lib())
    assert stack._nccl_version_of("/fake/libnccl.so.2") == text


H200X2 = json.loads((FIXTURES / "probes" / "h200x2-probe-quick.json").read_text())


def test_nvswitch_links_count_for_the_pair_on_the_recorded_two_h200_machine():
    """Recorded on the two-H200 machine (2026-11-29): every link's remote is FFFFFFFF:FF:FF.0, an NVSwitch;
    `nvidia-smi topo -m` said NV18 between the cards."""
    c0, c1 = H200X2["cards"]
    assert c0["nvlink"]["active_links"] == 18
    assert p2p.nvlink_between(c0, c1) == (18, "switch")
    assert p2p.nvlink_between(c1, c0) == (18, "switch")


def test_recorded_two_h200_pairs_work_and_are_judged(cli):
    from v100plan import documents

    documents.validate(H200X2, "probe_report")
    assert [p["verdict"] for p in H200X2["pairs"]] == ["working", "working"]
    assert all(p["ipc_cross_device"] for p in H200X2["pairs"])
    stack_case = next(c for c in H200X2["cases"] if c["key"] == "software_stack")
    assert stack_case["details"]["allreduce"] == "40 KB NCCL allreduce over all cards: right sum"
    r = cli("probe", "--from", FIXTURES / "probes" / "h200x2-probe-quick.json", "--json")
    assert r.exit_code == 0, r.stderr
    rows = json.loads(r.stdout)["verdicts"]
    assert [row["status"] for row in rows if row["check"] == "P2P"] == ["passed", "passed"]
