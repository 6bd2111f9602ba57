"""The bundled engine's speeds on a card generation it has no recording on, from a model of its own kernels.

The engine profile's ``kernel_model`` names the generation its kernels were measured on (``reference``) and,
per weight-format family and for the K/V read, the instructions its decode kernels issue per byte read
(docs/engine-speed.md: the int4 GEMV ~3.3 per nibble = 6.6 per byte; a 16-bit weight one FMA and one
conversion per 2 bytes; an int8 K/V value one conversion and one FMA). On another card:

  ALU-bound fraction   = lanes per SM x SMs x SM clock / (instructions per byte x read bandwidth)
  weight, K/V fraction = min(the reference generation's measured fraction, the ALU-bound fraction)
  round overhead       = the reference overhead x reference SM clock / the card's SM clock (launch costs)

The reference's fractions hold what the memory system loses (first loads, tails); the card's own lanes and
clock say whether its ALUs keep up (Volta's fp16 path is FMA, no MMA). It is not a calibration: the plan
labels such speeds uncalibrated and widens their interval (uncertainty.py, kind "kernel_model").
"""

from __future__ import annotations

from typing import Any

from v100plan.planner.inputs import Card, Engine, Sourced


def applies(engine: Engine, card: Card | None) -> bool:
    km = engine.kernel_model
    return bool(km and card is not None and card.architecture and card.architecture != km.get("reference", {}).get("generation")
                and card.architecture in (km.get("lanes_per_sm") or {}) and card.sm_count and card.sm_clock_mhz
                and card.read_bw.value)


def alu_fraction(km: dict[str, Any], card: Card, instructions_per_byte: float) -> float:
    """Lanes x SMs x clock / (instructions per byte x bandwidth): the fraction at which the ALUs, not memory, limit."""
    lane_ops = km["lanes_per_sm"][card.architecture] * card.sm_count * card.sm_clock_mhz * 1e6
    return lane_ops / (instructions_per_byte * card.read_bw.value * 1e9)


def speeds(engine: Engine, card: Card, fw_ref: Sourced, fk_ref: Sourced, oh_ref: Sourced, family: str,
           kv_dtype: str) -> tuple[Sourced, Sourced, Sourced, str]:
    """(weight fraction, KV fraction, overhead, note) for ``card`` from the reference figures (module docstring)."""
    km = engine.kernel_model
    ref = km["reference"]
    ipb = km["instructions_per_byte"]
    w_ipb = ipb.get(family) or ipb["float"]
    k_ipb = ipb.get(f"kv_{kv_dtype}") or ipb["kv"]
    w_alu, k_alu = alu_fraction(km, card, w_ipb), alu_fraction(km, card, k_ipb)
    fw = min(fw_ref.value, w_alu)
    fk = min(fk_ref.value, k_alu)
    oh = oh_ref.value * ref["sm_clock_mhz"] / card.sm_clock_mhz
    src = f"kernel model (uncalibrated): {engine.id}'s {ref['generation']} figures"
    note = (f"speeds NOT calibrated: engine {engine.id} has no recording on {card.architecture}; its kernel model stands in "
            f"(weight min({fw_ref.value:g} measured on {ref['generation']}, ALU bound {w_alu:.2f} at {w_ipb:g} instructions "
            f"a byte) = {fw:.3f}; K/V min({fk_ref.value:g}, {k_alu:.2f}) = {fk:.3f}; overhead {oh_ref.value:g} ms x "
            f"{ref['sm_clock_mhz']:g} / {card.sm_clock_mhz:g} MHz = {oh:.2f} ms; {km.get('source', '')})")
    return (Sourced(round(fw, 4), src + f", ALU bound {w_alu:.2f}"), Sourced(round(fk, 4), src + f", ALU bound {k_alu:.2f}"),
            Sourced(round(oh, 4), src + " x SM clock ratio"), note)
