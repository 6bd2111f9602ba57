"""The NVML gateway and the inventory, run on CPU against real answers recorded on the lent H200."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from probes import inventory, nvml, replay
from probes.context import Options, ProbeContext
from tests.conftest import FIXTURES, REPO

ANSWERS = FIXTURES / "probes" / "h200-nvml-answers.json"


@pytest.fixture
def h200_nvml():
    nvml.reset_for_tests(replay.load(ANSWERS))
    yield
    nvml.reset_for_tests(None)


def test_inventory_from_recorded_h200_answers(h200_nvml):
    ctx = ProbeContext(Options.for_mode("quick"))
    inventory.discover(ctx)
    assert ctx.nvml_problem is None and len(ctx.cards) == 1
    assert ctx.host["driver_version"] == "580.159.04" and ctx.host["cuda_driver_version"] == "13.0"
    card = ctx.cards[0]
    inventory.read_card(card)
    v = card.values
    assert v["pci_device_id"] == "10de:2335" and v["pci_subsystem_id"] == "10de:18bf"
    assert v["compute_capability"] == "9.0"
    assert (v["sm_clock_max_mhz"], v["mem_clock_max_mhz"], v["bus_width_bits"]) == (1980, 3201, 6016)
    # 3201 MHz x 2 (double data rate) x 6016 bits / 8 = 4814 GB/s
    assert v["implied_bw_gbps"] == pytest.approx(4814.3, abs=0.1)
    assert v["power_limit_w"] == 700.0 and v["temp_slowdown_c"] == 89
    assert v["serial_sha256"] and "scrubbed" not in v["serial_sha256"]


def test_nvlink_not_supported_is_a_reason_not_a_crash(h200_nvml):
    ctx = ProbeContext(Options.for_mode("quick"))
    inventory.discover(ctx)
    card = ctx.cards[0]
    inventory.read_card(card)
    assert card.values["nvlink"] is None
    assert "NotSupported" in card.unavailable["nvlink"] and "NVLink" in card.unavailable["nvlink"]
    # Volta-style retired pages answer NotSupported on Hopper; remapped rows answer instead.
    assert "NotSupported" in card.unavailable["retired_pages"]
    assert card.values["remapped_rows"] == {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False}


def test_gateway_turns_any_nvml_error_into_a_reason():
    class Boom(Exception):
        pass

    NotSupported = type("NVMLError_NotSupported", (Boom,), {})

    class Fake:
        def nvmlInit(self):
            pass

        def nvmlDeviceGetPowerUsage(self, h):
            raise NotSupported("Not Supported")

    nvml.reset_for_tests(Fake())
    try:
        r = nvml.query("nvmlDeviceGetPowerUsage", "h")
        assert r.value is None and r.reason.startswith("NVML answers NotSupported for nvmlDeviceGetPowerUsage")
        missing = nvml.query("nvmlDeviceGetSomethingNew", "h")
        assert missing.value is None and "no nvmlDeviceGetSomethingNew" in missing.reason
    finally:
        nvml.reset_for_tests(None)


def test_no_driver_waives_every_case_and_exits_3():
    """This CI machine has no NVIDIA driver: the probe says so and measures nothing."""
    r = subprocess.run([sys.executable, "-m", "probes", "--quick"], capture_output=True, text=True, timeout=60,
                       cwd=REPO)
    report = json.loads(r.stdout)
    if report["host"]["gpu_count"]:
        pytest.skip("a GPU is present here")
    assert r.returncode == 3, r.stderr
    assert report["overall"] == "nothing_measured"
    assert {c["status"] for c in report["cases"]} == {"waived"}
    assert all("NVML" in c["reason"] or "driver" in c["reason"] for c in report["cases"])
    assert report["cards"] == []
