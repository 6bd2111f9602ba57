"""Which allreduce path a TP pair uses, and what one allreduce costs, on two cards or more.

Path names are the engine's flags and metrics: nccl, gloo, host_mailbox, device_mailbox, none; and
torch_intra_node, PyTorch's own one-shot/two-shot intra-node kernels (``ENABLE_INTRA_NODE_COMM=1``),
which an engine profile names as its ``allreduce_path`` when its published runs used them (gpt-fast).
Latencies come from the box (hardware profile or probe report) first, else from the engine profile's
figures (docs/field-figures.md: measured on the field report's V100 boxes), and say which.

An engine with its own path (``allreduce_path`` other than nccl) is priced on that path's figures for
the box; where the box has none, or the path cannot run there, NCCL's figures stand in and the plan
says so.

Wider than two cards (tp4, tp8): one allreduce costs what the box's table for that many cards says
(the hardware profile's 'box', published runs: docs/field-figures.md), interpolated in message size
like the pair's: latency(n GPUs, fabric) at small sizes plus bytes over the bandwidth the larger
measured sizes imply. NCCL picks ring or tree and the LL protocol at decode sizes itself; a measured
table already holds what it picked. Without a table for that count: log2(tp) two-card allreduces
(recursive doubling), and the plan says so.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from v100plan.planner.inputs import Engine, Hardware

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([kKmM]?)$")


def size_key_bytes(key: str) -> float | None:
    """'8k' -> 8192, '40k' -> 40960, '1m' -> 1048576, '20m' -> 20971520 (None if not a size)."""
    m = _SIZE.match(key)
    if not m:
        return None
    return float(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]


def latency_us_at(table: dict[str, float], message_bytes: float, bulk_gbps: float | None = None) -> float:
    """One allreduce of ``message_bytes`` from a size-keyed table of measured latencies.

    Between two sizes: linear interpolation. Below the smallest: the smallest's figure
    (latency-bound). Above the largest: the largest figure plus the extra bytes over
    ``bulk_gbps`` when the link's bulk bandwidth is known, else scaled in proportion
    to the bytes (the largest measured message's effective bandwidth).
    """
    points = sorted((b, us) for k, us in table.items() if (b := size_key_bytes(k)) is not None)
    if not points:
        raise ValueError("empty latency table")
    if message_bytes <= points[0][0]:
        return points[0][1]
    for (b0, u0), (b1, u1) in zip(points, points[1:]):
        if message_bytes <= b1:
            return u0 + (u1 - u0) * (message_bytes - b0) / (b1 - b0)
    b_max, u_max = points[-1]
    if bulk_gbps:
        return u_max + (message_bytes - b_max) / (bulk_gbps * 1e3)
    return u_max * message_bytes / b_max


@dataclass(frozen=True)
class PathChoice:
    path: str                 # chosen for decode-sized messages
    decode_us: float          # one decode-sized allreduce on that path
    prefill_path: str         # chosen for prefill chunks (NCCL or a mailbox, whichever is faster)
    prefill_us: float         # one prefill-chunk allreduce
    source: str
    rejected: tuple[str, ...]  # "path: why not" for every path not chosen


def _table_for(path: str, hw: Hardware, engine: Engine) -> tuple[dict[str, float] | None, str]:
    if hw.pair.allreduce_us.get(path):
        return hw.pair.allreduce_us[path], f"{hw.origin}: {hw.pair.allreduce_source}"
    if hw.box_allreduce_us.get(2, {}).get(path):
        return hw.box_allreduce_us[2][path], f"{hw.origin}: {hw.box_source(2, path)}"
    if engine.allreduce_us.get(path):
        return engine.allreduce_us[path], (f"engine {engine.id}'s figure (not measured on {hw.card.id}; "
                                           "run `v100plan probe` on the box)")
    return None, ""


def path_problem(path: str, hw: Hardware) -> str | None:
    """Why ``path`` cannot carry this pair's allreduces, or None if it can.

    docs/field-figures.md: broken P2P rules out the device mailbox (a 4 KB direct copy took 49 ms);
    an NCCL without kernels for the card's architecture crashes at start (2.31 on sm_70).
    """
    if path == "gloo":
        return "gloo is the CPU path; GPUs use nccl or a mailbox"
    if path == "torch_intra_node":
        # PyTorch c10d IntraNodeComm (intra_node_comm.cu/.cpp): isIntraNodeCommSupported() is false below
        # sm_80, and the kernels run only when every pair of cards is NVLink-connected (or an 8-card hybrid
        # cube mesh); otherwise the same all_reduce call goes to NCCL.
        try:
            major = int(str(hw.card.compute_capability).split(".")[0])
        except ValueError:
            major = 0
        if major < 8:
            return "PyTorch's intra-node allreduce needs compute capability 8.0 or newer; NCCL carries these allreduces"
        if hw.pair.interconnect != "nvlink" or hw.pair.p2p == "broken":
            return "PyTorch's intra-node allreduce needs NVLink between the cards; NCCL carries these allreduces"
    if path == "nccl" and hw.pair.nccl_supported is False:
        return hw.pair.nccl_why or "the installed NCCL has no kernels for this card's architecture"
    if path == "device_mailbox" and hw.pair.p2p != "working":
        return ("peer-to-peer is broken on this box" if hw.pair.p2p == "broken"
                else "peer-to-peer is not known to work (the engine's start-up self-test may still enable it)")
    return None


def own_path_fallback(engine: Engine, why: str) -> str:
    """The note when an engine's own path (not nccl) has no usable figure here and NCCL's stand in."""
    return f"{engine.allreduce_path}: engine {engine.id} runs its allreduces on it, but {why}: NCCL's figures stand in"


def choose_path(hw: Hardware, engine: Engine, decode_message_bytes: float, prefill_message_bytes: float) -> PathChoice | None:
    """The pair's path and its decode and prefill-chunk allreduce; None if no path has a figure.

    An engine with its own path (``allreduce_path`` not nccl) takes that path when it can run on this box and
    the box has a figure for it; otherwise the fastest usable path of ``allreduce_paths`` (NCCL for engines
    that run on NCCL), with the fallback named among the rejected paths."""
    bulk = hw.pair.bulk_gbps()

    def us(entry, size):
        path, table, _ = entry
        return latency_us_at(table, size, bulk if path != "host_mailbox" else None)

    rejected: list[str] = []
    own = engine.allreduce_path
    if own != "nccl":
        why = path_problem(own, hw)
        table, source = _table_for(own, hw, engine)
        if why is None and table is not None:
            entry = (own, table, source)
            others = [p for p in engine.allreduce_paths if p != own]
            return PathChoice(path=own, decode_us=us(entry, decode_message_bytes), prefill_path=own,
                              prefill_us=us(entry, prefill_message_bytes), source=entry[2],
                              rejected=tuple(f"{p}: engine {engine.id} runs its allreduces on {own}" for p in others))
        rejected.append(own_path_fallback(engine, why or f"there is no two-card {own} figure for {hw.origin}"))
    usable: list[tuple[str, dict[str, float], str]] = []
    for path in engine.allreduce_paths:
        if path == own and own != "nccl":
            continue
        why = path_problem(path, hw)
        if why:
            rejected.append(f"{path}: {why}")
            continue
        table, source = _table_for(path, hw, engine)
        if table is None:
            rejected.append(f"{path}: no latency figure for this box or engine")
            continue
        usable.append((path, table, source))
    if not usable:
        return None
    best = min(usable, key=lambda e: us(e, decode_message_bytes))
    best_prefill = min(usable, key=lambda e: us(e, prefill_message_bytes))
    for e in usable:
        if e[0] != best[0]:
            rejected.append(f"{e[0]}: {us(e, decode_message_bytes):.1f} us per decode allreduce, slower")
    return PathChoice(
        path=best[0], decode_us=us(best, decode_message_bytes), prefill_path=best_prefill[0],
        prefill_us=us(best_prefill, prefill_message_bytes), source=best[2], rejected=tuple(rejected),
    )


def allreduce_ms_per_round(allreduces_per_round: int, us_each: float) -> float:
    """allreduces per round x latency of one (docs/field-figures.md: 134 x 16 us = 2.1 ms on the PCIe box's host mailbox)."""
    return allreduces_per_round * us_each / 1e3


@dataclass(frozen=True)
class WideAllreduce:
    us: float          # one decode-sized allreduce across tp cards (0: not priced)
    path: str
    source: str        # where the figure comes from, or why there is none
    measured: bool     # True: the box's own table for this many cards


@dataclass(frozen=True)
class BoxTable:
    path: str
    table: dict[str, float]
    source: str        # where the figures come from (and the fallback, when the engine's own path had none)


def box_table(hw: Hardware, engine: Engine, tp: int, choice: PathChoice | None) -> BoxTable | None:
    """The box's table for ``tp`` cards that prices this engine: its own path's (``allreduce_path``) first,
    then the pair's chosen path, then the engine's other paths; None when the box has none of them.
    When the engine's own path is not nccl and has no usable table here, the source says NCCL's stands in."""
    tables = hw.box_allreduce_us.get(tp, {})
    own = engine.allreduce_path
    order = [own] + ([choice.path] if choice else []) + list(engine.allreduce_paths)
    fallback = ""
    if own != "nccl" and (own not in tables or path_problem(own, hw)):
        why = path_problem(own, hw) or f"there is no {tp}-GPU {own} figure for {hw.origin}"
        fallback = "; " + own_path_fallback(engine, why)
    for path in dict.fromkeys(order):
        if path in tables and path_problem(path, hw) is None:
            return BoxTable(path, tables[path], hw.box_source(tp, path) + fallback)
    return None


def wide_allreduce(hw: Hardware, engine: Engine, tp: int, message_bytes: float, choice: PathChoice | None) -> WideAllreduce:
    """One decode allreduce of ``message_bytes`` across ``tp`` (> 2) cards of one box.

    The box's table for ``tp`` cards (box_table: the engine's own path first, NCCL's standing in, said);
    without one, log2(tp) x the two-card figure (recursive doubling: log2(tp) exchange steps, each about one
    two-card allreduce at these sizes); with no two-card figure either, not priced (0)."""
    bulk = hw.pair.bulk_gbps()
    # Past the largest measured size: a ring moves 2(n-1)/n of the message over each card's link
    # (nccl-tests' bus bandwidth = algorithm bandwidth x 2(n-1)/n), so the message goes at bulk x n / 2(n-1).
    algo_gbps = bulk * tp / (2 * (tp - 1)) if bulk else None
    found = box_table(hw, engine, tp, choice)
    if found:
        return WideAllreduce(latency_us_at(found.table, message_bytes, algo_gbps), found.path,
                             f"{hw.origin}: {tp}-GPU figure on {found.path}: {found.source}", True)
    if choice and choice.decode_us > 0:
        return WideAllreduce(choice.decode_us * math.log2(tp), choice.path,
                             f"log2({tp}) x the two-card figure ({choice.source}); no {tp}-GPU figure for {hw.origin}", False)
    return WideAllreduce(0.0, choice.path if choice else "none",
                         f"no {tp}-GPU or two-card allreduce figure for {hw.origin}: not priced", False)
