"""How wrong a prediction may be: a p10-p90 interval on decode tok/s, prefill and time to first token.

An interval is the prediction times two factors, measured / predicted at the 10th and 90th percentile of past
errors of predictions obtained the same way (the bands document, profiles/published/intervals.json, fitted by
`v100plan bench planner --fit-intervals` on the training points only: v100plan/interval_fit.py). The way a
figure was obtained is its *rung*, by distance from a calibration of its own:

  calibrated          this engine, card generation and format were fitted (residuals of that slice)
  format              the engine's figure for another weight format of the same generation
  kernel_model        the bundled engine's model of its own kernels on a generation it has no recording on
  generation          the engine's figures from another card generation (nearest_generation likewise)
  sibling_engine      another engine's figures (another engine family)

A rung's band is never narrower than the rung before it (widened by a fitted amount by distance). Where the
plan carries an "unmodelled: X" warning (a config structure the planner does not price), the band is widened
again by the ``unmodelled`` factors. The decode interval's upper end is capped by the ceiling (100 % bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RUNGS = ("calibrated", "format", "kernel_model", "generation", "sibling_engine")
_RUNG_OF = {"nearest_generation": "generation"}


def rung(stand_in: dict[str, Any] | None) -> str:
    """The rung of a plan's speeds record's stand_in (None: calibrated)."""
    if not stand_in:
        return "calibrated"
    kind = stand_in.get("kind", "generation")
    return _RUNG_OF.get(kind, kind)


@dataclass(frozen=True)
class Band:
    p10: float          # measured / predicted at the 10th percentile
    p90: float          # ... at the 90th
    source: str


def band(bands: dict[str, Any] | None, quantity: str, rung_: str, unmodelled: bool = False) -> Band | None:
    """The band for ``quantity`` ("decode" or "prefill") at ``rung_`` from the bands document; None without one."""
    if not bands or quantity not in bands:
        return None
    table = bands[quantity]
    entry = table.get(rung_) or table.get(RUNGS[-1])
    if entry is None:
        return None
    p10, p90 = float(entry["p10"]), float(entry["p90"])
    src = f"{quantity} {rung_}: {entry.get('points', '?')} past points ({entry.get('source', 'bands document')})"
    if unmodelled and bands.get("unmodelled"):
        u = bands["unmodelled"]
        p10, p90 = p10 * float(u["p10"]), p90 * float(u["p90"])
        src += f"; widened for unmodelled structures ({u.get('source', '')})"
    return Band(p10, p90, src)


def interval(value: float | None, b: Band | None, cap: float | None = None) -> list[float] | None:
    """[value x p10, value x p90] (the top at most ``cap``); None without a value or a band."""
    if value is None or b is None:
        return None
    lo, hi = value * b.p10, value * b.p90
    if cap is not None:
        hi = min(hi, cap)
        lo = min(lo, hi)
    return [round(lo, 2), round(hi, 2)]


def time_interval(seconds: float | None, b: Band | None) -> list[float] | None:
    """A time's interval: a speed measured p x the predicted one takes 1 / p x the predicted time."""
    if seconds is None or b is None:
        return None
    return [round(seconds / b.p90, 2), round(seconds / b.p10, 2)]


def overlap(a: list[float] | None, b: list[float] | None) -> bool | None:
    """Whether two intervals share any value (None when either is missing)."""
    if not a or not b:
        return None
    return a[0] <= b[1] and b[0] <= a[1]
