"""Judging a ProbeReport against the catalogue: which variant each card is, and whether its
measured figures are what that variant should give.

probes/ reports raw facts and its own measured verdicts (P2P broken, throttling, stack);
this module names the variant from the PCI ids (profiles/hardware/*.json
``pci_device_ids``) and compares. A PCI id the catalogue does not know gets generic
expectations (bandwidth implied by its own memory clock and bus) and a warning row,
never a silent skip.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from v100plan.cards import identify

__all__ = ["Judgement", "Row", "identify", "judge", "nothing_measured"]

# Measured read bandwidth over the bandwidth the memory clock implies: tuned read kernels reach 0.91-0.95
# on an H200 (docs/probes.md) and 0.93-0.98 on V100s (docs/field-figures.md); under 0.85 the card or its
# setup is off, under 0.70 it is failing.
READ_OK_FRACTION = 0.85
READ_POOR_FRACTION = 0.70

STATUS_ORDER = {"passed": 0, "waived": 1, "warned": 2, "failed": 3}


@dataclasses.dataclass(frozen=True)
class Row:
    subject: str  # "card 0", "pair 0->1", "host"
    check: str
    status: str  # passed | warned | failed | waived
    detail: str


@dataclasses.dataclass(frozen=True)
class Judgement:
    rows: list[Row]
    report: dict[str, Any]  # the report with variant_id filled per card

    @property
    def worst(self) -> str:
        return max((r.status for r in self.rows), key=STATUS_ORDER.get, default="waived")

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [dataclasses.asdict(r) for r in self.rows], "worst": self.worst}


def _value(x: Any) -> Any:
    """A catalogue number may be plain or a sourced_number {"value": ..., "source": ...}."""
    return x.get("value") if isinstance(x, dict) else x


def _num(profile: dict[str, Any], key: str) -> float | None:
    v = _value(profile.get(key))
    return float(v) if isinstance(v, (int, float)) else None


def _card_rows(card: dict[str, Any], profile: dict[str, Any] | None, how: str, n_cards: int) -> list[Row]:
    subject = f"card {card['index']}"
    rows = []
    if profile is None:
        rows.append(Row(subject, "variant", "warned",
                        f"{card.get('name')}: {how}; judged with generic expectations "
                        f"(its own memory clock x bus width); add a profile to profiles/hardware/"))
    else:
        rows.append(Row(subject, "variant", "passed", f"{profile['id']} ({profile.get('name', '')}), by {how}"))
        want_mhz, got_mhz = _num(profile, "mem_clock_max_mhz"), card.get("mem_clock_max_mhz")
        if want_mhz and got_mhz:
            same = abs(got_mhz - want_mhz) <= 0.01 * want_mhz
            rows.append(Row(subject, "memory clock", "passed" if same else "warned",
                            f"max {got_mhz} MHz" + ("" if same else f", the catalogue's {profile['id']} has "
                                                                      f"{want_mhz:.0f} MHz: a different SKU or BIOS")))
    implied = card.get("implied_bw_gbps")
    if implied is None and profile is not None:
        implied = _num(profile, "mem_bw_nominal_gbps")
    read = card.get("read_bw_gbps")
    if read is None:
        why = (card.get("unavailable") or {}).get("read_bw_gbps", "not measured")
        rows.append(Row(subject, "read bandwidth", "waived", why))
    elif implied:
        frac = read / implied
        status = "passed" if frac >= READ_OK_FRACTION else "warned" if frac >= READ_POOR_FRACTION else "failed"
        text = f"{read:.0f} GB/s = {frac:.0%} of the {implied:.0f} GB/s its memory clock implies"
        nominal = _num(profile, "mem_bw_nominal_gbps") if profile else None
        if nominal:
            text += f" (catalogue nominal {nominal:.0f} GB/s)"
        rows.append(Row(subject, "read bandwidth", status, text))
    else:
        rows.append(Row(subject, "read bandwidth", "warned", f"{read:.0f} GB/s; nothing to compare with"))
    t = card.get("throttle") or {}
    verdict = t.get("verdict", "not_measured")
    status = {"clean": "passed", "power_capped": "warned", "thermally_limited": "failed"}.get(verdict, "waived")
    detail = t.get("explanation") or verdict.replace("_", " ")
    rows.append(Row(subject, "throttle", status, detail))
    for lib, key in (("NCCL", "nccl_supported"), ("torch", "torch_supported")):
        v = card.get(key)
        cc = card.get("compute_capability")
        if v is True:
            rows.append(Row(subject, f"{lib} kernels", "passed", f"the installed {lib} has code for sm_"
                                                                 f"{(cc or '?').replace('.', '')}"))
        elif v is False:
            # NCCL only matters with two or more cards; torch always does.
            bad = "failed" if (lib == "torch" or n_cards > 1) else "warned"
            rows.append(Row(subject, f"{lib} kernels", bad, f"the installed {lib} has no code for sm_"
                                                            f"{(cc or '?').replace('.', '')}"))
        else:
            why = (card.get("unavailable") or {}).get(key, "not checked")
            rows.append(Row(subject, f"{lib} kernels", "waived", why))
    return rows


def _pair_rows(pair: dict[str, Any]) -> list[Row]:
    subject = f"pair {pair['src']}->{pair['dst']}"
    verdict = pair.get("verdict", "not_measured")
    status = {"working": "passed", "broken": "failed", "unavailable": "warned"}.get(verdict, "waived")
    detail = pair.get("explanation") or verdict
    links = pair.get("nvlink_links")
    if links and "NVLink" not in detail:
        detail += f"; {links} NVLink links"
    return [Row(subject, "P2P", status, detail)]


def judge(report: dict[str, Any], hardware: list[dict[str, Any]],
          catalogue_problems: list[str] | None = None) -> Judgement:
    """Rows for every card, pair and the host; the returned report has variant_id filled in."""
    out = copy.deepcopy(report)
    rows: list[Row] = []
    if catalogue_problems:
        rows.append(Row("catalogue", "hardware profiles", "warned",
                        f"{len(catalogue_problems)} profile(s) unreadable, their cards get generic expectations: "
                        f"{catalogue_problems[0]}"))
    cards = out.get("cards", [])
    for card in cards:
        profile, how = identify(card, hardware)
        card["variant_id"] = profile["id"] if profile else None
        unavailable = card.setdefault("unavailable", {})
        if profile:
            unavailable.pop("variant_id", None)
        else:
            unavailable["variant_id"] = how + " (generic expectations used)"
        rows += _card_rows(card, profile, how, len(cards))
    for pair in out.get("pairs", []):
        rows += _pair_rows(pair)
    if len(cards) == 1:
        rows.append(Row("pairs", "P2P", "waived", "one card: no pair to measure"))
    for case in out.get("cases", []):
        if case["status"] == "error":
            rows.append(Row("probe", case["key"], "failed", f"error: {case.get('reason')}"))
    if not cards:
        why = (out.get("host", {}).get("unavailable") or {}).get("gpu_count") or "no NVIDIA card found"
        rows.append(Row("host", "cards", "waived", why))
    return Judgement(rows=rows, report=out)


def nothing_measured(report: dict[str, Any]) -> bool:
    return report.get("overall") == "nothing_measured" or all(
        c.get("status") == "waived" for c in report.get("cases", []))
