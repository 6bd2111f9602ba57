"""Lazy access to the GPU libraries a probe may use (cupy for kernels, torch for references).

Each returns the module or raises Missing with a sentence saying what to install;
nothing is imported until a case needs it, so ``python -m probes`` starts on a
host with neither.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any


class Missing(RuntimeError):
    """A library the case needs is not importable or sees no GPU."""


def cupy() -> Any:
    try:
        import cupy as cp
    except Exception as e:  # noqa: BLE001 - ImportError or a CUDA load failure
        raise Missing(f"cupy is not usable ({type(e).__name__}: {e}); install the cupy build for this CUDA") from e
    return cp


def torch() -> Any:
    try:
        import torch as t
    except Exception as e:  # noqa: BLE001
        raise Missing(f"torch is not usable ({type(e).__name__}: {e})") from e
    if not t.cuda.is_available():
        raise Missing("torch sees no CUDA device (a CPU build, or no driver)")
    return t


def available(*which: str) -> str | None:
    """None when every named library is usable, else why not."""
    for name in which:
        try:
            {"cupy": cupy, "torch": torch}[name]()
        except Missing as e:
            return str(e)
    return None


def time_events_ms(fn: Callable[[], Any], event_pair: Callable[[], tuple[Any, Any]],
                   elapsed_ms: Callable[[Any, Any], float], warmup: int, runs: int) -> list[float]:
    """Time ``fn`` ``runs`` times between device events after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = event_pair()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(elapsed_ms(start, end))
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)
