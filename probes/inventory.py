"""Inventory through NVML: what each card is and what state it is in.

By hand: ``nvidia-smi -q`` (all of it), ``nvidia-smi -q -d CLOCK`` (max clocks),
``nvidia-smi --query-gpu=pci.device_id,pci.sub_device_id --format=csv`` (PCI ids).
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

from probes import nvml
from probes.cases import Outcome, case, needs_cards
from probes.context import CardState, ProbeContext

_XID = re.compile(r"NVRM: Xid.*")


def discover(ctx: ProbeContext) -> None:
    """Start NVML and create one CardState per card NVML sees (before any case runs)."""
    ctx.nvml_problem = nvml.init()
    if ctx.nvml_problem:
        ctx.set_host("gpu_count", None, ctx.nvml_problem)
        return
    count = nvml.query("nvmlDeviceGetCount")
    if not count.ok:
        ctx.nvml_problem = count.reason
        ctx.set_host("gpu_count", None, count.reason)
        return
    ctx.set_host("gpu_count", int(count.value))
    ctx.cards = [CardState(i) for i in range(int(count.value))]
    driver = nvml.query("nvmlSystemGetDriverVersion")
    ctx.set_host("driver_version", driver.value, driver.reason)
    cuda = nvml.query("nvmlSystemGetCudaDriverVersion_v2", convert=lambda v: f"{v // 1000}.{(v % 1000) // 10}")
    ctx.set_host("cuda_driver_version", cuda.value, cuda.reason)


def _pci_id(raw: int) -> str:
    """NVML packs the PCI id as device<<16 | vendor: 0x1DF010DE -> "10de:1df0"."""
    return f"{raw & 0xFFFF:04x}:{(raw >> 16) & 0xFFFF:04x}"


def _put(card: CardState, field: str, reading: nvml.Reading) -> None:
    card.set(field, reading.value, reading.reason)


def read_card(card: CardState) -> None:
    h = nvml.query("nvmlDeviceGetHandleByIndex", card.index)
    if not h.ok:
        for f in ("name", "pci_device_id", "compute_capability"):
            card.set(f, None, h.reason)
        return
    handle = h.value
    q = nvml.query
    c = nvml.const
    _put(card, "name", q("nvmlDeviceGetName", handle))
    pci = q("nvmlDeviceGetPciInfo", handle)
    if pci.ok:
        card.set("pci_device_id", _pci_id(pci.value.pciDeviceId))
        card.set("pci_subsystem_id", _pci_id(pci.value.pciSubSystemId))
        bus = pci.value.busId
        card.set("pci_bus_id", bus.decode() if isinstance(bus, bytes) else str(bus))
    else:
        for f in ("pci_device_id", "pci_subsystem_id", "pci_bus_id"):
            card.set(f, None, pci.reason)
    serial = q("nvmlDeviceGetSerial", handle)
    # The serial identifies one physical card; reports keep only a hash so they can be shared.
    card.set("serial_sha256", hashlib.sha256(serial.value.encode()).hexdigest()[:16] if serial.ok else None,
             serial.reason)
    _put(card, "compute_capability", q("nvmlDeviceGetCudaComputeCapability", handle,
                                       convert=lambda v: f"{v[0]}.{v[1]}"))
    _put(card, "sm_clock_max_mhz", q("nvmlDeviceGetMaxClockInfo", handle, c("NVML_CLOCK_SM", 1)))
    _put(card, "mem_clock_max_mhz", q("nvmlDeviceGetMaxClockInfo", handle, c("NVML_CLOCK_MEM", 2)))
    _put(card, "sm_clock_now_mhz", q("nvmlDeviceGetClockInfo", handle, c("NVML_CLOCK_SM", 1)))
    _put(card, "mem_clock_now_mhz", q("nvmlDeviceGetClockInfo", handle, c("NVML_CLOCK_MEM", 2)))
    _put(card, "bus_width_bits", q("nvmlDeviceGetMemoryBusWidth", handle))
    _put(card, "memory_total_gib", q("nvmlDeviceGetMemoryInfo", handle,
                                     convert=lambda m: round(m.total / 2**30, 2)))
    _put(card, "power_limit_w", q("nvmlDeviceGetEnforcedPowerLimit", handle, convert=lambda mw: mw / 1000))
    _put(card, "temp_now_c", q("nvmlDeviceGetTemperature", handle, c("NVML_TEMPERATURE_GPU", 0)))
    _put(card, "temp_slowdown_c", q("nvmlDeviceGetTemperatureThreshold", handle,
                                    c("NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", 1)))
    _put(card, "temp_shutdown_c", q("nvmlDeviceGetTemperatureThreshold", handle,
                                    c("NVML_TEMPERATURE_THRESHOLD_SHUTDOWN", 0)))
    _put(card, "pcie_gen_current", q("nvmlDeviceGetCurrPcieLinkGeneration", handle))
    _put(card, "pcie_gen_max", q("nvmlDeviceGetMaxPcieLinkGeneration", handle))
    _put(card, "pcie_width_current", q("nvmlDeviceGetCurrPcieLinkWidth", handle))
    _put(card, "pcie_width_max", q("nvmlDeviceGetMaxPcieLinkWidth", handle))
    _put(card, "ecc_mode_enabled", q("nvmlDeviceGetEccMode", handle, convert=lambda m: bool(m[0])))
    uncorrected = c("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
    _put(card, "ecc_uncorrected_volatile", q("nvmlDeviceGetTotalEccErrors", handle, uncorrected,
                                             c("NVML_VOLATILE_ECC", 0)))
    _put(card, "ecc_uncorrected_aggregate", q("nvmlDeviceGetTotalEccErrors", handle, uncorrected,
                                              c("NVML_AGGREGATE_ECC", 1)))
    # Remapped rows exist from Ampere on; Volta retires pages instead. Each answers NotSupported on the other.
    _put(card, "remapped_rows", q("nvmlDeviceGetRemappedRows", handle, convert=lambda r: {
        "correctable": r[0], "uncorrectable": r[1], "pending": bool(r[2]), "failure": bool(r[3])}))
    _put(card, "retired_pages", q("nvmlDeviceGetRetiredPages", handle,
                                  c("NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1), convert=len))
    sm = q("nvmlDeviceGetNumGpuCores", handle)  # CUDA cores; SMs come from the CUDA runtime instead
    card.values.setdefault("cuda_cores", sm.value)
    read_nvlink(card, handle)
    mem, width = card.values.get("mem_clock_max_mhz"), card.values.get("bus_width_bits")
    if mem and width:
        # Double data rate: two transfers per memory clock, bus width in bits / 8 bytes.
        card.set("implied_bw_gbps", round(mem * 1e6 * 2 * width / 8 / 1e9, 1))
    else:
        card.set("implied_bw_gbps", None, "needs the max memory clock and the bus width from NVML")


def read_nvlink(card: CardState, handle) -> None:  # noqa: ANN001 - an NVML handle
    """NVLink state, version and remote PCI bus per link (``nvidia-smi nvlink -s`` by hand)."""
    max_links = nvml.const("NVML_NVLINK_MAX_LINKS", 18)
    links, reasons = [], set()
    for link in range(max_links):
        state = nvml.query("nvmlDeviceGetNvLinkState", handle, link)
        if not state.ok:
            reasons.add(state.reason)
            continue
        version = nvml.query("nvmlDeviceGetNvLinkVersion", handle, link)
        remote = nvml.query("nvmlDeviceGetNvLinkRemotePciInfo", handle, link,
                            convert=lambda p: p.busId.decode() if isinstance(p.busId, bytes) else str(p.busId))
        kind = nvml.query("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)  # 0 GPU, 1 IBM NPU, 2 switch
        links.append({"link": link, "active": bool(state.value), "version": version.value,
                      "remote_pci_bus_id": remote.value, "remote_device_type": kind.value})
    if links:
        card.set("nvlink", {"links": links, "active_links": sum(1 for x in links if x["active"])})
    else:
        why = "; ".join(sorted(r for r in reasons if r)) or "no NVLink links"
        card.set("nvlink", None, f"NVLink unavailable: {why}")


def read_xid_events() -> tuple[list[str] | None, str | None]:
    """Recent Xid lines from the kernel log (``dmesg | grep Xid`` by hand), or why they cannot be read."""
    try:
        r = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
        if r.returncode == 0:
            return [m.group(0) for m in _XID.finditer(r.stdout)][-20:], None
        why = f"dmesg refused: {r.stderr.strip()[:120] or 'exit ' + str(r.returncode)}"
    except (OSError, subprocess.SubprocessError) as e:
        why = f"dmesg not runnable: {e}"
    for log in (Path("/var/log/kern.log"), Path("/var/log/syslog")):
        try:
            return [m.group(0) for m in _XID.finditer(log.read_text(errors="replace"))][-20:], None
        except OSError:
            continue
    return None, why + "; no readable /var/log/kern.log or syslog"


@case("inventory", "Name every card through NVML: PCI ids, clocks, bus, memory, ECC, PCIe, power, temperatures",
      order=10, timeout_s=60, applicable=needs_cards)
def run_inventory(ctx: ProbeContext) -> Outcome:
    for card in ctx.cards:
        read_card(card)
    xids, why = read_xid_events()
    ctx.set_host("xid_events", xids, why)
    warnings = []
    for card in ctx.cards:
        v = card.values
        if v.get("ecc_uncorrected_volatile"):
            warnings.append(f"card {card.index}: {v['ecc_uncorrected_volatile']} uncorrected ECC errors since boot")
        rows = v.get("remapped_rows") or {}
        if rows.get("pending") or rows.get("failure"):
            warnings.append(f"card {card.index}: row remapping pending or failed ({rows})")
        if v.get("pcie_width_current") and v.get("pcie_width_max") and v["pcie_width_current"] < v["pcie_width_max"]:
            warnings.append(f"card {card.index}: PCIe link x{v['pcie_width_current']} of x{v['pcie_width_max']}")
    if xids:
        warnings.append(f"{len(xids)} Xid error(s) in the kernel log, the last: {xids[-1]}")
    names = ", ".join(f"{c.index}: {c.values.get('name')} ({c.values.get('pci_device_id')})" for c in ctx.cards)
    if warnings:
        return Outcome("warned", "; ".join(warnings), {"cards": names})
    return Outcome("passed", None, {"cards": names})
