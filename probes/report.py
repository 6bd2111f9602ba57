"""The ProbeReport document as frozen dataclasses (stdlib only; v100plan/ imports this too).

Units are in the field names. A field that could not be had is ``None`` and its
record's ``unavailable`` maps the field name to the reason. The JSON form is
``ProbeReport.to_dict()`` and is described by profiles/schema/probe_report.schema.json.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from profiles.document import SCHEMA_VERSIONS

KIND = "probe_report"


def _fill_reasons(values: dict[str, Any], unavailable: dict[str, str], default_reason: str) -> dict[str, str]:
    """Every None field gets a reason: the one recorded, else ``default_reason``."""
    out = dict(unavailable)
    for k, v in values.items():
        if v is None and k not in out:
            out[k] = default_reason
    return {k: r for k, r in out.items() if k in values and values[k] is None}


@dataclasses.dataclass(frozen=True)
class Throttle:
    """Clocks under a sustained load, sampled through NVML."""

    verdict: str = "not_measured"
    sm_clock_median_mhz: float | None = None
    sm_clock_min_mhz: float | None = None
    sm_clock_max_mhz: int | None = None  # the card's maximum, the ratio's denominator
    sm_clock_ratio: float | None = None  # median under load / max
    mem_clock_median_mhz: float | None = None
    temp_peak_c: int | None = None
    temp_slowdown_c: int | None = None
    power_median_w: float | None = None
    power_limit_w: float | None = None
    share_by_reason: dict[str, float] = dataclasses.field(default_factory=dict)
    duration_s: float | None = None
    sample_hz: float | None = None
    explanation: str = ""
    samples: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # raw: t_s, sm_mhz, ...
    unavailable: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Card:
    index: int
    name: str
    pci_device_id: str | None = None  # "10de:1df0"
    pci_subsystem_id: str | None = None  # "10de:18bf" (subsystem vendor:device)
    pci_bus_id: str | None = None
    serial_sha256: str | None = None  # first 16 hex digits of the serial's SHA-256
    variant_id: str | None = None  # filled by the control plane from the catalogue
    compute_capability: str | None = None  # "7.0"
    sm_count: int | None = None
    sm_clock_max_mhz: int | None = None
    mem_clock_max_mhz: int | None = None
    sm_clock_now_mhz: int | None = None
    mem_clock_now_mhz: int | None = None
    bus_width_bits: int | None = None
    memory_total_gib: float | None = None
    l2_cache_mib: float | None = None
    power_limit_w: float | None = None
    temp_now_c: int | None = None
    temp_slowdown_c: int | None = None
    temp_shutdown_c: int | None = None
    pcie_gen_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_current: int | None = None
    pcie_width_max: int | None = None
    ecc_mode_enabled: bool | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    remapped_rows: dict[str, Any] | None = None  # correctable, uncorrectable, pending, failure
    retired_pages: int | None = None
    read_bw_gbps: float | None = None
    copy_bw_gbps: float | None = None  # bytes read + bytes written per second
    implied_bw_gbps: float | None = None  # mem clock x 2 (DDR) x bus width / 8
    bandwidth: dict[str, Any] | None = None  # method, launch shape, buffer, references, runs
    nccl_supported: bool | None = None
    torch_supported: bool | None = None
    cupy_supported: bool | None = None
    nvlink: dict[str, Any] | None = None  # links: [{link, active, version, remote_pci_bus_id}], active_links
    throttle: Throttle = dataclasses.field(default_factory=Throttle)
    unavailable: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Pair:
    src: int
    dst: int
    peer_access_reported: bool | None = None
    p2p_direct_4k_us: float | None = None
    host_staged_4k_us: float | None = None
    p2p_bulk_gbps: float | None = None
    nvlink_links: int | None = None
    ipc_cross_device: bool | None = None
    verdict: str = "not_measured"
    explanation: str = ""
    unavailable: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Host:
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    nccl_version: str | None = None
    nccl_archs: list[str] | None = None  # ["sm_70", "compute_90", ...] from the library file
    nccl_library: str | None = None
    torch_version: str | None = None
    torch_cuda_version: str | None = None
    torch_arch_list: list[str] | None = None
    cupy_version: str | None = None
    cupy_cuda_version: str | None = None
    nvrtc_archs: list[str] | None = None
    gpu_count: int | None = None
    xid_events: list[str] | None = None
    stack_verdict: str | None = None
    stack_fix: str | None = None
    nccl_libraries: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    unavailable: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class CaseResult:
    key: str
    description: str
    status: str  # one of STATUSES
    reason: str | None
    duration_s: float
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ProbeReport:
    provenance: dict[str, Any]
    host: Host
    cards: list[Card]
    pairs: list[Pair]
    cases: list[CaseResult]
    overall: str  # passed | warned | failed | nothing_measured
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        doc = {"kind": KIND, "schema_version": SCHEMA_VERSIONS[KIND]}
        doc.update(_plain(self))
        return doc


def _plain(obj: Any) -> Any:
    """dataclasses -> dicts, tuples -> lists, with every None field's reason guaranteed."""
    if dataclasses.is_dataclass(obj):
        values = {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if "unavailable" in values:
            values["unavailable"] = _fill_reasons(values, values["unavailable"], "not measured in this run")
        return values
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def overall_status(cases: list[CaseResult]) -> str:
    """failed if any case failed or errored; nothing_measured if all were waived; else warned/passed."""
    statuses = {c.status for c in cases}
    if statuses & {"failed", "error"}:
        return "failed"
    if not statuses or statuses == {"waived"}:
        return "nothing_measured"
    return "warned" if "warned" in statuses else "passed"


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def from_dict(doc: dict[str, Any]) -> ProbeReport:
    """The same object from its JSON form (a fixture, a report received over SSH)."""
    cards = []
    for c in doc.get("cards", []):
        c = dict(c)
        c["throttle"] = Throttle(**_known(Throttle, c.get("throttle") or {}))
        cards.append(Card(**_known(Card, c)))
    return ProbeReport(
        provenance=doc["provenance"],
        host=Host(**_known(Host, doc.get("host", {}))),
        cards=cards,
        pairs=[Pair(**_known(Pair, p)) for p in doc.get("pairs", [])],
        cases=[CaseResult(**_known(CaseResult, c)) for c in doc.get("cases", [])],
        overall=doc.get("overall", overall_status([CaseResult(**_known(CaseResult, c)) for c in doc.get("cases", [])])),
        wall_s=doc.get("wall_s", 0.0),
    )
