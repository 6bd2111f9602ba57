"""The acceptance suite's cases, in the one case protocol of probes/case_runner.py: a stable key, a
one-line description, a group, applicable(ctx) -> the reason to waive it or None, run(ctx) -> Outcome,
and a timeout. The shared runner turns an exception (in applicable() too) or a timeout into "error" and
goes on: a scenario that did not run is never "passed".
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class Repetition:
    """One repetition of a fault: what happened, seconds after the injection."""

    index: int
    status: str = "passed"
    time_to_detect_s: float | None = None
    time_to_recover_s: float | None = None
    detail: str = ""
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def mark(self, t_s: float, label: str) -> None:
        self.events.append({"t_s": round(t_s, 4), "label": label})

    def fail(self, why: str) -> None:
        self.status = "failed"
        self.detail = (self.detail + "; " if self.detail else "") + why

    def to_dict(self) -> dict[str, Any]:
        r = lambda v: None if v is None else round(v, 4)  # noqa: E731
        return {"index": self.index, "status": self.status, "time_to_detect_s": r(self.time_to_detect_s),
                "time_to_recover_s": r(self.time_to_recover_s), "detail": self.detail, "events": self.events}


@dataclasses.dataclass
class Outcome:
    """What a case's run() found. Checks append failures; the status follows from them."""

    failures: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    evidence: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    repetitions: list[Repetition] = dataclasses.field(default_factory=list)

    def check(self, ok: bool, why: str) -> bool:
        """Record `why` as a failure unless `ok`; returns ok so callers can stop early."""
        if not ok:
            self.failures.append(why)
        return ok

    def warn(self, why: str) -> None:
        self.warnings.append(why)

    def note(self, kind: str, text: str, http_status: int | None = None, at_s: float | None = None) -> None:
        self.evidence.append({"kind": kind, "text": text[:2000], "http_status": http_status,
                              "at_s": None if at_s is None else round(at_s, 4)})

    @property
    def status(self) -> str:
        if self.failures or any(r.status in ("failed", "error") for r in self.repetitions):
            return "failed"
        return "warned" if self.warnings else "passed"

    @property
    def reason(self) -> str | None:
        rep = [f"repetition {r.index}: {r.detail}" for r in self.repetitions if r.status in ("failed", "error")]
        parts = self.failures + rep + ([] if self.failures or rep else self.warnings)
        return "; ".join(parts) if parts else None


@dataclasses.dataclass(frozen=True)
class Case:
    key: str
    description: str
    group: str                                   # functional | fault | load
    run: Callable[[Any], Outcome]
    applicable: Callable[[Any], str | None]
    timeout_s: Callable[[Any], float]


_REGISTRY: dict[str, Case] = {}


def case(key: str, description: str, *, group: str, timeout_s: float | Callable[[Any], float],
         applicable: Callable[[Any], str | None] | None = None):
    """Register `run` as an acceptance case (decorator); cases run in registration order."""

    def wrap(run: Callable[[Any], Outcome]) -> Callable[[Any], Outcome]:
        if key in _REGISTRY:
            raise ValueError(f"acceptance case {key!r} registered twice")
        timeout = timeout_s if callable(timeout_s) else (lambda _ctx, t=float(timeout_s): t)
        _REGISTRY[key] = Case(key, description, group, run, applicable or (lambda _ctx: None), timeout)
        return run

    return wrap


def registry() -> list[Case]:
    from v100plan.accept import concurrency, faults, features, functional, images, load, structured  # noqa: F401 - registers the cases

    return list(_REGISTRY.values())


def spread(values: list[float | None]) -> dict[str, Any] | None:
    """Median and worst (largest) of the measured values; None when nothing was measured."""
    got = [v for v in values if v is not None]
    if not got:
        return None
    return {"median": round(statistics.median(got), 4), "worst": round(max(got), 4), "n": len(got)}


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of `values`; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]
