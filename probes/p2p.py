"""Peer-to-peer between cards, per ordered pair, and the two-process CUDA IPC check.

Per pair (src, dst): peer access as the driver reports it; a 4 KB copy src -> dst
(direct: torch uses cudaMemcpyPeer, over P2P when peer access is on); the same 4 KB
staged through pinned host memory (src -> host, host -> dst); bulk 256 MiB src -> dst;
NVLink links between them from NVML. Latencies are the median wall time of many
synchronised copies. Verdict: "broken" when the direct copy is over 10x slower than
staging (FACTS.md: 49 ms vs 16 us), "unavailable" when the driver reports no peer
access, else "working". By hand: ``nvidia-smi topo -p2p r`` and ``nvidia-smi nvlink -s``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from probes import gpu, ipc
from probes.cases import Outcome, case, needs_cards, needs_pairs
from probes.context import ProbeContext

SMALL_FLOATS = 1024  # 4 KB
BULK_BYTES = 256 * 2**20
BROKEN_FACTOR = 10.0


def _median_us(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def measure_pair(torch: Any, s: int, d: int, runs: int) -> dict[str, Any]:
    out: dict[str, Any] = {"peer_access_reported": bool(torch.cuda.can_device_access_peer(s, d))}
    src = torch.rand(SMALL_FLOATS, device=f"cuda:{s}")
    dst = torch.empty(SMALL_FLOATS, device=f"cuda:{d}")
    host = torch.empty(SMALL_FLOATS).pin_memory()

    def sync() -> None:
        torch.cuda.synchronize(s)
        torch.cuda.synchronize(d)

    def direct() -> None:
        dst.copy_(src)
        sync()

    def staged() -> None:
        host.copy_(src)
        torch.cuda.synchronize(s)
        dst.copy_(host, non_blocking=True)
        torch.cuda.synchronize(d)

    direct()  # warm-up: enables peer access, creates streams
    staged()
    first = _median_us(direct, 1)
    # A broken path costs tens of ms a copy: fewer repeats keep the probe inside its time.
    n = runs if first < 1000 else 5
    out["p2p_direct_4k_us"] = round(_median_us(direct, n), 2)
    out["host_staged_4k_us"] = round(_median_us(staged, runs), 2)
    if not bool((dst == src.to(f"cuda:{d}")).all()):
        out["copy_wrong"] = True
    big_src = torch.empty(BULK_BYTES // 4, device=f"cuda:{s}").uniform_()
    big_dst = torch.empty(BULK_BYTES // 4, device=f"cuda:{d}")

    def bulk() -> None:
        big_dst.copy_(big_src)
        sync()

    bulk()
    bulk_us = _median_us(bulk, 3 if out["p2p_direct_4k_us"] > 1000 else 10)
    out["p2p_bulk_gbps"] = round(BULK_BYTES / (bulk_us * 1e-6) / 1e9, 1)
    return out


def verdict_of(m: dict[str, Any]) -> tuple[str, str]:
    if m.get("copy_wrong"):
        return "broken", "the direct copy delivered wrong data"
    if m.get("peer_access_reported") is False:
        return "unavailable", "the driver reports no peer access between these cards; copies go through the host"
    d, h = m.get("p2p_direct_4k_us"), m.get("host_staged_4k_us")
    if d is None or h is None:
        return "not_measured", "latencies were not measured"
    if d > BROKEN_FACTOR * h:
        return "broken", (f"P2P reported but a 4 KB direct copy takes {d:.0f} us vs {h:.0f} us through host "
                          f"memory ({d / h:.0f}x slower): use host staging")
    return "working", f"4 KB direct {d:.1f} us vs staged {h:.1f} us; bulk {m.get('p2p_bulk_gbps')} GB/s"


def _bus(x: str | None) -> str:
    return (x or "").lower()[-7:]  # "bb:dd.f": NVML pads the domain differently across calls


# NVML names an NVSwitch as the remote end of a link by this all-ones PCI address (seen on the
# two-H200 machine, 2026-11-29: 18 links per card, every remote FFFFFFFF:FF:FF.0, topo NV18) or by
# remote device type 2 (NVML_NVLINK_DEVICE_TYPE_SWITCH).
SWITCH_BUS = "ff:ff.0"
SWITCH_TYPE = 2


def _to_switch(link: dict[str, Any]) -> bool:
    return _bus(link.get("remote_pci_bus_id")) == SWITCH_BUS or link.get("remote_device_type") == SWITCH_TYPE


def nvlink_between(src_values: dict[str, Any], dst_values: dict[str, Any]) -> tuple[int | None, str | None]:
    """(active links from src that reach dst, "direct" | "switch"), or (None, None) when NVLink is unknown.

    Direct links name the peer's PCI address. On NVSwitch boards every link goes to a switch,
    so two cards that both have switch links reach each other over the fewer of their counts.
    """
    nv, peer = src_values.get("nvlink"), dst_values.get("nvlink")
    if not nv:
        return None, None
    target = _bus(dst_values.get("pci_bus_id"))
    direct = sum(1 for link in nv["links"] if link["active"] and _bus(link.get("remote_pci_bus_id")) == target)
    if direct:
        return direct, "direct"
    src_sw = sum(1 for link in nv["links"] if link["active"] and _to_switch(link))
    dst_sw = sum(1 for link in (peer or {}).get("links", []) if link["active"] and _to_switch(link))
    if src_sw and dst_sw:
        return min(src_sw, dst_sw), "switch"
    return 0, None


def nvlink_links_between(src_values: dict[str, Any], dst_values: dict[str, Any]) -> int | None:
    return nvlink_between(src_values, dst_values)[0]


def _p2p_applicable(ctx: ProbeContext) -> str | None:
    return needs_pairs(ctx) or gpu.available("torch")


@case("p2p", "Per ordered pair: peer access, 4 KB direct vs host-staged latency, bulk bandwidth, NVLink links",
      order=40, timeout_s=240, applicable=_p2p_applicable)
def run_p2p(ctx: ProbeContext) -> Outcome:
    torch = gpu.torch()
    runs = 50 if ctx.options.mode == "quick" else 200
    broken, lines = [], {}
    for s_card in ctx.cards:
        for d_card in ctx.cards:
            if s_card.index == d_card.index:
                continue
            s, d = s_card.index, d_card.index
            pair = ctx.pair(s, d)
            m = measure_pair(torch, s, d, runs)
            pair.update({k: v for k, v in m.items() if k != "copy_wrong"})
            links, via = nvlink_between(s_card.values, d_card.values)
            pair["nvlink_links"] = links
            if links is None:
                pair["unavailable"]["nvlink_links"] = s_card.unavailable.get("nvlink", "NVLink state unknown")
            pair["verdict"], pair["explanation"] = verdict_of(m)
            if links:
                pair["explanation"] += f"; {links} NVLink links" + (" through an NVSwitch" if via == "switch" else "")
            lines[f"{s}->{d}"] = pair["explanation"]
            if pair["verdict"] == "broken":
                broken.append(f"{s}->{d}: {pair['explanation']}")
    ctx.method["p2p"] = f"median wall time of {runs} synchronised 4 KB copies; bulk {BULK_BYTES >> 20} MiB"
    if broken:
        return Outcome("failed", "P2P broken: " + "; ".join(broken), lines)
    return Outcome("passed", None, lines)


def _ipc_applicable(ctx: ProbeContext) -> str | None:
    return needs_cards(ctx) or gpu.available("cupy")


@case("cuda_ipc", "Two processes share a device buffer through CUDA IPC (the device mailbox's mechanism)",
      order=50, timeout_s=240, applicable=_ipc_applicable)
def run_ipc(ctx: ProbeContext) -> Outcome:
    cp = gpu.cupy()
    results, failed = {}, []
    checks = [(0, 0)]
    if len(ctx.cards) > 1:
        checks += [(0, 1), (1, 0)]
    for s, d in checks:
        ok, text = ipc.check(cp, s, d)
        results[f"{s}->{d}"] = text
        if s != d:
            ctx.pair(s, d)["ipc_cross_device"] = ok
        if not ok:
            failed.append(f"{s}->{d}: {text}")
    if failed:
        # Cross-device IPC failing where P2P is broken is expected: the engine then uses the host mailbox.
        same = [f for f in failed if f.startswith("0->0")]
        return Outcome("failed" if same else "warned", "; ".join(failed), results)
    return Outcome("passed", None, results)
