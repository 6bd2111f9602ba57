"""Peer-to-peer between cards, per ordered pair, and the two-process CUDA IPC check.

Per pair (src, dst): peer access as the driver reports it (enabled here when reported);
the device-side latency of a 4 KB copy src -> dst (direct: cudaMemcpyAsync device to
device, over P2P once peer access is on) and of the same 4 KB staged through pinned host memory
(src -> host on a stream of src, plus host -> dst on a stream of dst); bulk 256 MiB
src -> dst timed with device events; NVLink links between them from NVML.

Each 4 KB latency is a chain of 100 copies captured in one CUDA graph and timed with
device events, per copy = elapsed / 100, median over repeats (probes/copy_latency.py says
why and what is left in the figure). Host-staged = D2H per copy + H2D per copy: the hand-over
between the two (someone noticing the D2H is done) is not in it, as the receiver noticing
the data is not in the direct figure. The old figure, the median wall time of one copy plus
host synchronisation, is kept in the case details as a sanity check: it is the host's round
trip (about 30 us on the lent H200 VMs for either path) and must not be below the device time.

Verdict: "broken" when the direct copy is over 10x slower than staging (docs/field-figures.md: 49 ms vs
16 us), "unavailable" when the driver reports no peer access, else "working".
By hand: ``nvidia-smi topo -p2p r`` and ``nvidia-smi nvlink -s``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from probes import copy_latency, gpu, ipc
from probes.cases import Outcome, case, needs_cards, needs_pairs
from probes.context import ProbeContext

SMALL_BYTES = 4096
BULK_BYTES = 256 * 2**20
BROKEN_FACTOR = 10.0
WALL_RUNS = 20
HOST_ALLOC_PORTABLE = 1  # cudaHostAllocPortable: pinned for every device's context, not only src's
PEER_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled: a library enabled it before us


def method_text(runs: int) -> str:
    return (f"4 KB latencies on the device: a chain of {copy_latency.CHAIN_COPIES} copies on one stream in one "
            f"CUDA graph between device events, per copy = elapsed / {copy_latency.CHAIN_COPIES}, median of "
            f"{runs} launches (a path over {copy_latency.SLOW_COPY_US:.0f} us a copy: chains of "
            f"{copy_latency.SLOW_CHAIN_COPIES}, {copy_latency.SLOW_REPEATS} launches); direct = "
            "cudaMemcpyAsync device-to-device src->dst with peer access enabled; host-staged = D2H into pinned memory on "
            "src + H2D from it on dst, each chained the same way; bulk 256 MiB cudaMemcpyPeerAsync, "
            "event-timed median; wall time of one host-synchronised copy kept in the case details")


def _enable_peer(cp: Any, s: int, d: int) -> bool:
    """Whether the driver reports peer access s -> d; turned on when it does."""
    rt = cp.cuda.runtime
    if s == d:
        return True  # a card reaches its own memory; there is no peer mapping to enable
    if not rt.deviceCanAccessPeer(s, d):
        return False
    with cp.cuda.Device(s):
        try:
            rt.deviceEnablePeerAccess(d)
        except rt.CUDARuntimeError as e:
            if getattr(e, "status", None) != PEER_ALREADY_ENABLED and "AlreadyEnabled" not in str(e):
                raise
    return True


def _wall_us(cp: Any, device: int, issue: copy_latency.Issue, runs: int) -> float:
    """Median wall time of one copy followed by host synchronisation: the old figure, a sanity check."""
    with cp.cuda.Device(device):
        stream = cp.cuda.Stream(non_blocking=True)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            issue(stream.ptr)
            stream.synchronize()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _bulk_gbps(cp: Any, s: int, d: int, runs: int) -> float:
    rt = cp.cuda.runtime
    with cp.cuda.Device(s):
        big_src = cp.empty(BULK_BYTES, dtype=cp.uint8)
    with cp.cuda.Device(d):
        big_dst = cp.empty(BULK_BYTES, dtype=cp.uint8)
    with cp.cuda.Device(s):
        stream = cp.cuda.Stream(non_blocking=True)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for i in range(runs + 1):  # the first is a warm-up
            start.record(stream)
            rt.memcpyPeerAsync(big_dst.data.ptr, d, big_src.data.ptr, s, BULK_BYTES, stream.ptr)
            end.record(stream)
            end.synchronize()
            if i:
                times.append(cp.cuda.get_elapsed_time(start, end))
    return BULK_BYTES / (statistics.median(times) * 1e-3) / 1e9


def measure_pair(cp: Any, s: int, d: int, runs: int) -> dict[str, Any]:
    """Everything the pair row needs, plus "latency": the per-path chain timings and the wall check."""
    rt = cp.cuda.runtime
    out: dict[str, Any] = {"peer_access_reported": _enable_peer(cp, s, d)}
    n = SMALL_BYTES // 4
    with cp.cuda.Device(s):
        src = cp.random.random(n, dtype=cp.float32)  # [1024] float32 = 4 KB
    with cp.cuda.Device(d):
        dst_direct = cp.zeros(n, dtype=cp.float32)
        dst_staged = cp.zeros(n, dtype=cp.float32)
    host = rt.hostAlloc(SMALL_BYTES, HOST_ALLOC_PORTABLE)
    try:
        def direct(stream: int) -> None:
            # cudaMemcpyAsync, not cudaMemcpyPeerAsync: the latter cannot be captured in a graph
            # (the two-H200 run, 2026-11-29: cudaErrorStreamCaptureInvalidated). With unified
            # addressing and peer access on, a device-to-device copy across cards goes over P2P.
            rt.memcpyAsync(dst_direct.data.ptr, src.data.ptr, SMALL_BYTES, rt.memcpyDeviceToDevice, stream)

        def d2h(stream: int) -> None:
            rt.memcpyAsync(host, src.data.ptr, SMALL_BYTES, rt.memcpyDeviceToHost, stream)

        def h2d(stream: int) -> None:
            rt.memcpyAsync(dst_staged.data.ptr, host, SMALL_BYTES, rt.memcpyHostToDevice, stream)

        t_direct = copy_latency.time_chain(cp, s, direct, runs)
        t_d2h = copy_latency.time_chain(cp, s, d2h, runs)
        t_h2d = copy_latency.time_chain(cp, d, h2d, runs)  # after the D2H chains: host holds src's data
        slow = t_direct.single_copy_us > copy_latency.SLOW_COPY_US
        wall = _wall_us(cp, s, direct, 3 if slow else WALL_RUNS)
        if not (bool((cp.asnumpy(dst_direct) == cp.asnumpy(src)).all())
                and bool((cp.asnumpy(dst_staged) == cp.asnumpy(src)).all())):
            out["copy_wrong"] = True
    finally:
        for dev in {s, d}:
            cp.cuda.Device(dev).synchronize()
        rt.freeHost(host)
    out["p2p_direct_4k_us"] = round(t_direct.per_copy_us, 2)
    out["host_staged_4k_us"] = round(t_d2h.per_copy_us + t_h2d.per_copy_us, 2)
    out["latency"] = {"direct": t_direct.as_dict(), "d2h": t_d2h.as_dict(), "h2d": t_h2d.as_dict(),
                      "direct_wall_4k_us": round(wall, 2)}
    try:
        out["p2p_bulk_gbps"] = round(_bulk_gbps(cp, s, d, 3 if slow else 10), 1)
    finally:
        for dev in {s, d}:
            with cp.cuda.Device(dev):
                cp.get_default_memory_pool().free_all_blocks()
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


def timing_problem(m: dict[str, Any]) -> str | None:
    """Why the device timing cannot be right, or None.

    The wall time of one host-synchronised copy holds that whole copy, so a device-side
    figure well above it means the chain timing measured something else.
    """
    lat = m.get("latency") or {}
    wall, direct = lat.get("direct_wall_4k_us"), m.get("p2p_direct_4k_us")
    if wall is None or direct is None:
        return None
    if direct > 1.1 * wall + 1.0:
        return (f"device-timed 4 KB direct copy {direct:.1f} us is above the wall time of one synchronised copy "
                f"({wall:.1f} us): the chain timing is wrong on this host")
    return None


def _p2p_applicable(ctx: ProbeContext) -> str | None:
    return needs_pairs(ctx) or gpu.available("cupy")


@case("p2p", "Per ordered pair: peer access, 4 KB direct vs host-staged latency, bulk bandwidth, NVLink links",
      order=40, timeout_s=240, applicable=_p2p_applicable, needs=("inventory",))
def run_p2p(ctx: ProbeContext) -> Outcome:
    cp = gpu.cupy()
    runs = 50 if ctx.options.mode == "quick" else 200
    broken, odd, details = [], [], {}
    for s_card in ctx.cards:
        for d_card in ctx.cards:
            if s_card.index == d_card.index:
                continue
            s, d = s_card.index, d_card.index
            pair = ctx.pair(s, d)
            m = measure_pair(cp, s, d, runs)
            pair.update({k: v for k, v in m.items() if k not in ("copy_wrong", "latency")})
            links, via = nvlink_between(s_card.values, d_card.values)
            pair["nvlink_links"] = links
            if links is None:
                pair["unavailable"]["nvlink_links"] = s_card.unavailable.get("nvlink", "NVLink state unknown")
            pair["verdict"], pair["explanation"] = verdict_of(m)
            if links:
                pair["explanation"] += f"; {links} NVLink links" + (" through an NVSwitch" if via == "switch" else "")
            details[f"{s}->{d}"] = {"explanation": pair["explanation"], **m["latency"]}
            if pair["verdict"] == "broken":
                broken.append(f"{s}->{d}: {pair['explanation']}")
            problem = timing_problem(m)
            if problem:
                odd.append(f"{s}->{d}: {problem}")
    ctx.method["p2p"] = method_text(runs)
    if broken:
        return Outcome("failed", "P2P broken: " + "; ".join(broken + odd), details)
    if odd:
        return Outcome("warned", "; ".join(odd), details)
    return Outcome("passed", None, details)


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
