"""Which catalogued card a measured card is: the one identify() that the probe verdicts and the
planner both use, so one card is never named two SKUs.

In order: the ``variant_id`` a judged report already carries (when catalogued); the PCI device id
(profiles/hardware/*.json ``pci_device_ids``); among profiles sharing it, a unique PCI subsystem id; else
the closest memory size, then memory clock (RTX 4090 24G and 48G share a device id).
"""

from __future__ import annotations

from typing import Any


def _num(profile: dict[str, Any], key: str) -> float | None:
    v = profile.get(key)
    v = v.get("value") if isinstance(v, dict) else v
    return float(v) if isinstance(v, (int, float)) else None


def identify(card: dict[str, Any], hardware: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
    """The catalogue profile of ``card`` (a ProbeReport card) and how it was chosen, or (None, why not)."""
    by_id = {h["id"]: h for h in hardware}
    if card.get("variant_id") in by_id:
        return by_id[card["variant_id"]], f"variant id {card['variant_id']}"
    dev = (card.get("pci_device_id") or "").lower()
    if not dev:
        return None, "NVML gave no PCI device id"
    matches = [h for h in hardware if dev in [x.lower() for x in h.get("pci_device_ids", [])]]
    if not matches:
        return None, f"PCI id {dev} is not in the catalogue"
    if len(matches) == 1:
        return matches[0], f"PCI id {dev}"
    sub = (card.get("pci_subsystem_id") or "").lower()
    by_sub = [h for h in matches if sub and sub in [x.lower() for x in h.get("pci_subsystem_ids", [])]]
    if len(by_sub) == 1:
        return by_sub[0], f"PCI id {dev}, subsystem {sub}"
    pool = by_sub or matches
    mem = card.get("memory_total_gib")
    clock = card.get("mem_clock_max_mhz")

    def distance(h: dict[str, Any]) -> tuple[float, float]:
        gib, mhz = _num(h, "memory_gib"), _num(h, "mem_clock_max_mhz")
        return (abs(gib - mem) if gib is not None and mem is not None else 1e9,
                abs(mhz - clock) if mhz is not None and clock is not None else 1e9)

    best = min(pool, key=distance)
    return best, f"PCI id {dev} shared by {len(matches)} profiles; closest memory size and memory clock"


def by_device_name(device: str, hardware: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The one profile whose name starts with a CUDA device name without its vendor ("NVIDIA H200" ->
    "H200 SXM 141GB"); None when no profile or several do (a bench records names, not PCI ids)."""
    short = device.removeprefix("NVIDIA ").strip().lower()
    if not short:
        return None
    found = [h for h in hardware if str(h.get("name", "")).lower().split(" ")[0] == short.split(" ")[0]
             and str(h.get("name", "")).lower().startswith(short)]
    return found[0] if len(found) == 1 else None
