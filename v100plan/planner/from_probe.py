"""A ProbeReport (probes/, kind "probe_report") turned into the planner's Hardware.

- the catalogue profile of the identified variant (variant_id, else the PCI device id)
  gives what a probe does not measure (tensor peak, price);
- measured read bandwidth replaces nominal: the slowest card's, since a TP pair
  waits for it every layer and replicas are quoted per card;
- the slowest thermally limited card's SM clock ratio under load slows a TP pair
  (docs/field-figures.md: the pair runs at the hot card's speed). A power cap does not: the
  probe's load is matrix products at full power, while decode reads memory and
  draws far less, so the cap that bound the probe does not bind a decode round
  (on the lent H200 the cap held SM clocks at 0.73-0.77 of max under that load);
- any pair with verdict "broken" -> P2P broken (host mailbox); all "working" -> P2P working;
- a card whose NCCL has no kernels for its architecture rules NCCL out.
Pure: takes the parsed document and the catalogue documents, returns Hardware.
"""

from __future__ import annotations

from typing import Any

from v100plan.cards import identify
from v100plan.errors import BadInput
from v100plan.planner.inputs import Card, Hardware, Pair, Sourced, card_from_doc, pair_from_doc

# Below this median-clock ratio a throttle is taken to slow the pair (docs/field-figures.md, "Heat": "< ~0.97").
THROTTLE_RATIO = 0.97


def hardware_from_probe(report: dict[str, Any], catalogue: list[dict[str, Any]], source: str,
                        gpus: int | None = None) -> Hardware:
    cards = report.get("cards") or []
    if not cards:
        raise BadInput(f"{source}: the probe report has no cards", hint="probe a host with at least one NVIDIA GPU")
    if gpus is not None and gpus > len(cards):
        raise BadInput(f"--gpus {gpus} but the probe report {source} has {len(cards)} card(s)",
                       hint=f"leave --gpus out to plan on its {len(cards)} card(s), or probe the whole box")
    gpus = gpus or len(cards)
    used = cards[:gpus]
    notes: list[str] = []
    base, _how = identify(used[0], catalogue)  # the same card the probe's verdicts name (v100plan/cards.py)
    if base is None:
        raise BadInput(
            f"{source}: card 0 ({used[0].get('name')}, PCI {used[0].get('pci_device_id')}) is not in the catalogue",
            hint="`v100plan profiles list` shows the catalogued cards; add a hardware profile for this one",
        )
    card: Card = card_from_doc(base)
    pair: Pair = pair_from_doc(base)
    notes.append(f"hardware from probe report {source}: card matched catalogue profile {base['id']}")
    kinds = {(c.get("pci_device_id") or "").lower() for c in used}
    if len(kinds) > 1:
        notes.append(f"the cards differ (PCI ids {', '.join(sorted(kinds))}): planned as card 0's kind with the "
                     "slowest card's bandwidth and the smallest memory")

    measured = [c["read_bw_gbps"] for c in used if c.get("read_bw_gbps")]
    if measured:
        slowest = min(measured)
        card = _replace(card, read_bw=Sourced(slowest, f"measured: probe report {source}, slowest card's read bandwidth"))
    else:
        notes.append("probe report has no measured read bandwidth: using the catalogue's figure")
    mem = [c["memory_total_gib"] for c in used if c.get("memory_total_gib")]
    if mem:
        card = _replace(card, memory_gib=min(mem))

    ratios = []
    for c in used:
        t = c.get("throttle") or {}
        if t.get("verdict") == "power_capped":
            notes.append(f"card {c.get('index')} is power capped under the probe's matrix-product load; "
                         "decode draws less power, so the plan does not slow for it")
        if t.get("verdict") == "thermally_limited" and t.get("sm_clock_ratio") is not None:
            ratios.append((t["sm_clock_ratio"], c.get("index"), t["verdict"]))
    ratio = Sourced(None, "probe report: no card throttled under load")
    if ratios:
        worst = min(ratios)
        if worst[0] < THROTTLE_RATIO:
            ratio = Sourced(worst[0], f"probe report {source}: card {worst[1]} {worst[2]}, median SM clock {worst[0]:.2f} of max")
            notes.append(f"card {worst[1]} is {worst[2]} (SM clock ratio {worst[0]:.2f}): a TP pair runs at its speed")

    pairs = [p for p in report.get("pairs") or [] if p.get("src", 0) < gpus and p.get("dst", 0) < gpus]
    verdicts = {p.get("verdict") for p in pairs}
    p2p = pair.p2p
    if "broken" in verdicts:
        p2p = "broken"
        notes.append("probe report: direct P2P is broken between the cards; the device mailbox is ruled out")
    elif verdicts and verdicts <= {"working"}:
        p2p = "working"
    elif pairs:
        p2p = "unknown"
    links = [p.get("nvlink_links") for p in pairs if p.get("nvlink_links")]
    bulk = [p.get("p2p_bulk_gbps") for p in pairs if p.get("p2p_bulk_gbps")]

    nccl_supported, nccl_why = None, None
    flags = [c.get("nccl_supported") for c in used]
    if any(f is False for f in flags):
        archs = (report.get("host") or {}).get("nccl_archs")
        nccl_supported = False
        nccl_why = (f"the installed NCCL {(report.get('host') or {}).get('nccl_version') or ''} has no kernels for "
                    f"compute capability {used[0].get('compute_capability')} (it covers {archs or 'unknown archs'})")
        notes.append("NCCL ruled out: " + nccl_why)
    elif flags and all(f is True for f in flags):
        nccl_supported = True

    pair = Pair(
        interconnect="nvlink" if links else pair.interconnect, p2p=p2p, nccl_supported=nccl_supported, nccl_why=nccl_why,
        sm_clock_ratio=ratio, allreduce_us=pair.allreduce_us, allreduce_source=pair.allreduce_source,
        p2p_bulk_gbps=min(bulk) if bulk else pair.p2p_bulk_gbps, link_bw_nominal_gbps=pair.link_bw_nominal_gbps,
    )
    return Hardware(card=card, pair=pair, gpus=gpus, origin=source, notes=tuple(notes))


def _replace(card: Card, **kw: Any) -> Card:
    from dataclasses import replace

    return replace(card, **kw)
