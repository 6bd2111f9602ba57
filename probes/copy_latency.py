"""Device-side latency of one small copy: what the copy costs on the GPU, without the host round trip.

Timing a copy by the wall clock with a host synchronisation after it measures the host's
launch and wake-up (about 30 us on the lent H200 VMs, for a direct and a host-staged copy
alike), not the copy. Here instead the same copy is issued ``copies`` times back to back on
one stream, where stream order starts each copy only after the previous one has completed,
and the chain is captured in one CUDA graph so the host's launch gaps (a few us per call
from Python) are not between the copies. Device events recorded before and after one launch
of the graph give the chain's time; one copy = elapsed / copies; the figure is the median over
``repeats`` launches. What is left in it: the copy engine's set-up, the transfer, and the
completion the next copy waits for; plus the graph launch's own start, spread over the chain
(under 0.1 us a copy for 100 copies).

A path that takes milliseconds per copy (docs/field-figures.md: 49 ms for 4 KB on a box with broken
P2P) is sized from one event-timed copy first, and then timed with a chain of two, three
times, so the probe still finishes in about a second per pair.

Where graph capture fails, the chain is issued straight onto the stream and the method says
so: the host's launch gaps can then be inside the figure (an upper bound).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

CHAIN_COPIES = 100
SLOW_COPY_US = 1000.0  # a copy this slow is a broken path: a short chain, few repeats
SLOW_CHAIN_COPIES = 2
SLOW_REPEATS = 3

# Enqueue one copy on the stream whose handle (cudaStream_t as an int) is given.
Issue = Callable[[int], None]


@dataclasses.dataclass(frozen=True)
class Batch:
    copies: int  # copies in one chain (one graph launch)
    repeats: int  # timed launches; the median is reported


def batch_for(single_copy_us: float, repeats: int) -> Batch:
    """How long a chain and how many launches, from one copy's event-timed latency."""
    if single_copy_us > SLOW_COPY_US:
        return Batch(SLOW_CHAIN_COPIES, SLOW_REPEATS)
    return Batch(CHAIN_COPIES, repeats)


def per_copy_us(elapsed_ms: list[float], copies: int) -> float:
    """Median chain time over the launches, divided by the copies in a chain, in microseconds."""
    if not elapsed_ms or copies < 1:
        raise ValueError("need at least one timed chain of at least one copy")
    return statistics.median(elapsed_ms) * 1000.0 / copies


@dataclasses.dataclass(frozen=True)
class ChainTiming:
    per_copy_us: float  # median chain time / copies
    single_copy_us: float  # one copy between two events, after a warm-up copy (sizes the chain)
    copies: int
    repeats: int
    timing: str  # "cuda_graph", or "stream (...why the graph was not used)"

    def as_dict(self) -> dict[str, Any]:
        return {"per_copy_us": round(self.per_copy_us, 3), "single_copy_us": round(self.single_copy_us, 3),
                "copies": self.copies, "repeats": self.repeats, "timing": self.timing}


def _launcher(cp: Any, stream: Any, issue: Issue, copies: int) -> tuple[Callable[[], None], str]:
    """A callable that enqueues the chain on ``stream``: a captured graph, else plain stream calls."""
    try:
        stream.begin_capture()
        try:
            for _ in range(copies):
                issue(stream.ptr)
        finally:
            graph = stream.end_capture()
        return (lambda: graph.launch(stream)), "cuda_graph"
    except Exception as e:  # noqa: BLE001 - any capture failure falls back to the plain stream
        why = f"{type(e).__name__}: {e}".splitlines()[0][:160]

        def plain() -> None:
            for _ in range(copies):
                issue(stream.ptr)

        return plain, f"stream (graph capture failed: {why}; host launch gaps may be included)"


def time_chain(cp: Any, device: int, issue: Issue, repeats: int) -> ChainTiming:
    """Per-copy device time of ``issue``'s copy, chained on a fresh stream of ``device``."""
    with cp.cuda.Device(device):
        stream = cp.cuda.Stream(non_blocking=True)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        issue(stream.ptr)  # warm-up: peer mappings, copy-engine channel
        stream.synchronize()
        start.record(stream)
        issue(stream.ptr)
        end.record(stream)
        end.synchronize()
        single_us = cp.cuda.get_elapsed_time(start, end) * 1000.0
        batch = batch_for(single_us, repeats)
        launch, how = _launcher(cp, stream, issue, batch.copies)
        launch()  # warm-up: the graph's first launch uploads it
        stream.synchronize()
        elapsed = []
        for _ in range(batch.repeats):
            start.record(stream)
            launch()
            end.record(stream)
            end.synchronize()
            elapsed.append(cp.cuda.get_elapsed_time(start, end))
        return ChainTiming(per_copy_us(elapsed, batch.copies), single_us, batch.copies, batch.repeats, how)
