"""Throttle verdicts from samples: the recorded H200 (power cap, not heat) and synthetic cases."""

from __future__ import annotations

import json

import pytest

from probes.clock_reasons import decode
from probes.throttle_summary import summarise
from tests.conftest import FIXTURES


@pytest.fixture(scope="module")
def h200_card():
    return json.loads((FIXTURES / "probes" / "h200-probe-quick.json").read_text())["cards"][0]


def test_decode_reason_bits():
    assert decode(0x4) == ["sw_power_cap"]
    assert decode(0x24) == ["sw_power_cap", "sw_thermal_slowdown"]
    assert decode(0) == [] and decode(None) == []
    assert decode(0x1000) == ["bit_0x1000"]


def test_recorded_h200_samples_are_power_capped_not_heat(h200_card):
    t = h200_card["throttle"]
    samples = t["samples"]
    assert len(samples) >= 5 * 14  # 15 s at >= 5 Hz
    again = summarise(samples, sm_clock_max_mhz=1980, temp_slowdown_c=89, power_limit_w=700.0,
                      duration_s=t["duration_s"], sample_hz=t["sample_hz"])
    assert again.verdict == "power_capped"
    assert again.share_by_reason["sw_power_cap"] > 0.9
    assert again.share_by_reason["sw_thermal_slowdown"] == 0 and again.share_by_reason["hw_thermal_slowdown"] == 0
    assert 1400 <= again.sm_clock_median_mhz <= 1550  # the baseline saw 1440-1545 of 1980 MHz
    assert again.temp_peak_c < 89
    assert "not heat" in again.explanation
    assert again.sm_clock_median_mhz == t["sm_clock_median_mhz"]


def _samples(n, sm, temp, reasons, power=250.0):
    return [{"t_s": 1.0 + i * 0.1, "sm_mhz": sm, "mem_mhz": 877, "temp_c": temp, "power_w": power,
             "reasons": reasons} for i in range(n)]


def test_thermal_reason_wins_over_power():
    s = _samples(50, 1135, 84, 0x20 | 0x4)
    t = summarise(s, sm_clock_max_mhz=1530, temp_slowdown_c=None, power_limit_w=300.0, duration_s=5, sample_hz=10)
    assert t.verdict == "thermally_limited" and t.sm_clock_ratio == pytest.approx(1135 / 1530, abs=1e-3)


def test_reaching_the_slowdown_temperature_is_thermal_even_without_reason_bits():
    t = summarise(_samples(20, 1300, 90, None), sm_clock_max_mhz=1530, temp_slowdown_c=89, power_limit_w=None,
                  duration_s=2, sample_hz=10)
    assert t.verdict == "thermally_limited" and "share_by_reason" in t.unavailable


def test_full_clock_is_clean_and_no_samples_is_not_measured():
    t = summarise(_samples(20, 1530, 55, 0), sm_clock_max_mhz=1530, temp_slowdown_c=89, power_limit_w=300,
                  duration_s=2, sample_hz=10)
    assert t.verdict == "clean"
    low = summarise(_samples(20, 1200, 55, 0), sm_clock_max_mhz=1530, temp_slowdown_c=89, power_limit_w=300,
                    duration_s=2, sample_hz=10)
    assert low.verdict == "clean" and "no thermal or power reason" in low.explanation
    none = summarise([], sm_clock_max_mhz=1530, temp_slowdown_c=89, power_limit_w=300, duration_s=0, sample_hz=0)
    assert none.verdict == "not_measured"


def test_ramp_samples_are_left_out():
    ramp = [{"t_s": 0.1 * i, "sm_mhz": 1980, "temp_c": 40, "reasons": 0} for i in range(10)]
    t = summarise(ramp + _samples(30, 1455, 55, 0x4, power=690), sm_clock_max_mhz=1980, temp_slowdown_c=89,
                  power_limit_w=700, duration_s=4, sample_hz=10)
    assert t.sm_clock_median_mhz == 1455 and t.share_by_reason["sw_power_cap"] == 1.0
    assert len(t.samples) == 40  # raw samples are all kept


def test_the_quick_window_stops_at_steady_power_with_the_15_s_verdict(h200_card):
    """Replaying the recorded 15 s of H200 samples through quick mode's stop rule: it stops between its
    4 s minimum and 10 s maximum, and the shorter window reaches the same verdict and clocks."""
    from probes.context import QUICK_MAX_LOAD_S, QUICK_MIN_LOAD_S, Options
    from probes.throttle_summary import power_is_steady

    samples = h200_card["throttle"]["samples"]
    opts = Options.for_mode("quick")
    assert (opts.min_load_s, opts.load_duration_s) == (QUICK_MIN_LOAD_S, QUICK_MAX_LOAD_S)
    assert Options.for_mode("quick", 15.0).min_load_s is None  # a window given by hand runs whole
    stop = next(i for i in range(len(samples))
                if samples[i]["t_s"] >= opts.min_load_s and power_is_steady([samples[:i + 1]]))
    short = samples[:stop + 1]
    assert QUICK_MIN_LOAD_S <= short[-1]["t_s"] < QUICK_MAX_LOAD_S
    kw = dict(sm_clock_max_mhz=1980, temp_slowdown_c=89, power_limit_w=700.0, sample_hz=10.0)
    full = summarise(samples, duration_s=15.0, **kw)
    quick = summarise(short, duration_s=short[-1]["t_s"], **kw)
    assert quick.verdict == full.verdict == "power_capped"
    assert abs(quick.sm_clock_median_mhz - full.sm_clock_median_mhz) <= 30


def test_power_is_not_steady_while_it_ramps_or_is_not_read():
    from probes.throttle_summary import power_is_steady

    ramp = [{"t_s": i / 10, "power_w": 100.0 + 20 * i} for i in range(60)]
    assert not power_is_steady([ramp])
    flat = [{"t_s": i / 10, "power_w": 300.0} for i in range(60)]
    assert power_is_steady([flat])
    assert not power_is_steady([flat, [dict(s, power_w=None) for s in flat]])  # one card unread: run on
    assert not power_is_steady([flat[:25]])  # the 2 s window after the ramp is not covered yet
