"""An engine's fractions, calibrated on one card, carried to another card of the same generation.

The engine profile names the card its one-card fractions were measured on (``calibration_card``: SMs, SM
clock, read bandwidth). On another card of that generation the part of each read beyond full bandwidth
scales with compute (decode.compute_scaled_fraction) and the round's fixed overhead (launches, norms,
sampling: short kernels whose time is set by the SM clock) with the SM clock. On the calibration card, on
another generation, or where the card's SMs and clock are not known, nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from v100plan.planner.decode import compute_scaled_fraction
from v100plan.planner.inputs import Card, Engine, Sourced


@dataclass(frozen=True)
class CardScale:
    weight: Sourced
    kv: Sourced
    overhead_factor: float          # multiplies the round's fixed overhead
    note: str | None = None


def to_card(engine: Engine, card: Card, fw: Sourced, fk: Sourced) -> CardScale:
    """(weight fraction, KV fraction, overhead factor, note) for ``card`` (module docstring)."""
    ref = engine.calibration_card
    same = CardScale(fw, fk, 1.0)
    if (not ref or card.architecture != ref.get("generation") or not card.sm_count or not card.sm_clock_mhz
            or card.read_bw.value is None or fw.value is None or fk.value is None):
        return same
    bw_ratio = card.read_bw.value / ref["read_bw_gbps"]
    clock_ratio = card.sm_clock_mhz / ref["sm_clock_mhz"]
    compute_ratio = card.sm_count * clock_ratio / ref["sm_count"]
    if abs(bw_ratio - 1) < 1e-3 and abs(compute_ratio - 1) < 1e-3:
        return same
    w = compute_scaled_fraction(fw.value, bw_ratio, compute_ratio)
    k = compute_scaled_fraction(fk.value, bw_ratio, compute_ratio)
    why = (f"{card.id}: {bw_ratio:.3f} x the bandwidth and {compute_ratio:.3f} x the compute (SMs x SM clock) of "
           f"{engine.id}'s calibration card ({ref.get('source', 'its profile')})")
    note = (f"engine {engine.id}'s fractions carried to {card.id}: weight {fw.value:g} -> {w:.3f}, KV {fk.value:g} -> {k:.3f}, "
            f"overhead x {1 / clock_ratio:.3f} ({why}; the part of a read beyond full bandwidth scales with compute)")
    return CardScale(Sourced(round(w, 4), f"{fw.source}; carried to {card.id} by compute"),
                     Sourced(round(k, 4), f"{fk.source}; carried to {card.id} by compute"), 1 / clock_ratio, note)
