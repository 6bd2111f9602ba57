"""From NVML samples taken under load to a throttle verdict (pure: no GPU, testable on CPU).

Verdict rules, in order (samples of the first ``ramp_s`` seconds are left out: the
clocks are still rising):
- thermally_limited: a thermal slowdown reason was active in >= 5 % of samples, or the
  peak temperature reached the card's slowdown threshold;
- power_capped: the median SM clock is under 97 % of the max and a power reason
  (software power cap, power brake) was active in >= 5 % of samples;
- clean: otherwise (the explanation says when the clock was low with no reason given).
"""

from __future__ import annotations

import statistics
from typing import Any

from probes.clock_reasons import POWER, REASON_BITS, THERMAL, decode
from probes.report import Throttle

SLOWED_RATIO = 0.97
REASON_SHARE = 0.05


STEADY_WINDOW_S = 2.0
STEADY_TOLERANCE = 0.03


def power_is_steady(per_card: list[list[dict[str, Any]]], window_s: float = STEADY_WINDOW_S,
                    tolerance: float = STEADY_TOLERANCE, ramp_s: float = 1.0) -> bool:
    """Has every card's power held within ``tolerance`` of its mean for the last ``window_s`` seconds?

    Only samples after the ramp count, the window must be covered (its first sample at least ``window_s``
    before the last), and a card without power readings is never steady (the load then runs its whole
    window)."""
    if not per_card:
        return False
    for samples in per_card:
        if not samples:
            return False
        last = samples[-1].get("t_s") or 0.0
        recent = [s for s in samples if (s.get("t_s") or 0.0) >= max(ramp_s, last - window_s)]
        power = [s.get("power_w") for s in recent]
        if len(power) < 3 or any(p is None for p in power) or last - (recent[0].get("t_s") or 0.0) < window_s * 0.95:
            return False
        mean = sum(power) / len(power)
        if mean <= 0 or (max(power) - min(power)) > tolerance * mean:
            return False
    return True


def _median(xs: list[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def summarise(samples: list[dict[str, Any]], *, sm_clock_max_mhz: int | None, temp_slowdown_c: int | None,
              power_limit_w: float | None, duration_s: float | None, sample_hz: float | None,
              ramp_s: float = 1.0, keep_samples: bool = True) -> Throttle:
    """``samples``: dicts with t_s, sm_mhz, mem_mhz, temp_c, power_w, reasons (int bitmask); any may be None."""
    loaded = [s for s in samples if (s.get("t_s") or 0) >= ramp_s] or list(samples)
    unavailable: dict[str, str] = {}
    if not loaded:
        return Throttle(verdict="not_measured", explanation="no samples were taken",
                        unavailable={"sm_clock_median_mhz": "no samples were taken"})
    sm = [s["sm_mhz"] for s in loaded if s.get("sm_mhz") is not None]
    temps = [s["temp_c"] for s in loaded if s.get("temp_c") is not None]
    power = [s["power_w"] for s in loaded if s.get("power_w") is not None]
    masks = [s["reasons"] for s in loaded if s.get("reasons") is not None]
    share = {}
    if masks:
        for name in REASON_BITS:
            share[name] = round(sum(1 for m in masks if name in decode(m)) / len(masks), 4)
    else:
        unavailable["share_by_reason"] = "NVML gave no clock-event reasons on this card"
    median_sm = _median(sm)
    ratio = round(median_sm / sm_clock_max_mhz, 4) if median_sm and sm_clock_max_mhz else None
    temp_peak = max(temps) if temps else None
    thermal_share = max((share.get(n, 0.0) for n in THERMAL), default=0.0)
    power_share = max((share.get(n, 0.0) for n in POWER), default=0.0)
    hot = temp_peak is not None and temp_slowdown_c is not None and temp_peak >= temp_slowdown_c
    slowed = ratio is not None and ratio < SLOWED_RATIO
    clock_text = (f"median SM clock {median_sm:.0f} of {sm_clock_max_mhz} MHz ({ratio:.0%})"
                  if ratio is not None else "SM clock ratio unknown")
    temp_text = (f"peak {temp_peak} C" + (f" (slowdown at {temp_slowdown_c} C)" if temp_slowdown_c else "")
                 if temp_peak is not None else "temperature unknown")
    if thermal_share >= REASON_SHARE or hot:
        verdict = "thermally_limited"
        why = (f"thermal slowdown active {thermal_share:.0%} of the time" if thermal_share >= REASON_SHARE
               else "reached its slowdown temperature")
        explanation = f"thermally limited: {why}; {clock_text}; {temp_text}"
    elif slowed and power_share >= REASON_SHARE:
        verdict = "power_capped"
        pw = f"{_median(power):.0f} W of {power_limit_w:.0f} W" if power and power_limit_w else "power unknown"
        explanation = (f"power capped, not heat: power limit active {power_share:.0%} of the time at {pw}; "
                       f"{clock_text}; {temp_text}")
    else:
        verdict = "clean"
        explanation = f"clean: {clock_text}; {temp_text}"
        if slowed:
            explanation += "; the clock ran low with no thermal or power reason reported"
    return Throttle(
        verdict=verdict,
        sm_clock_median_mhz=median_sm,
        sm_clock_min_mhz=float(min(sm)) if sm else None,
        sm_clock_max_mhz=sm_clock_max_mhz,
        sm_clock_ratio=ratio,
        mem_clock_median_mhz=_median([s["mem_mhz"] for s in loaded if s.get("mem_mhz") is not None]),
        temp_peak_c=temp_peak,
        temp_slowdown_c=temp_slowdown_c,
        power_median_w=round(_median(power), 1) if power else None,
        power_limit_w=power_limit_w,
        share_by_reason=share,
        duration_s=duration_s,
        sample_hz=sample_hz,
        explanation=explanation,
        samples=list(samples) if keep_samples else [],
        unavailable=unavailable,
    )
