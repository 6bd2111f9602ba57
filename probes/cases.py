"""The one case protocol every probe follows, and the registry of cases.

A case has a stable ``key``, a one-line ``description``, ``applicable(ctx)``
returning the reason to waive it (or None), ``run(ctx)`` returning an
:class:`Outcome`, and a ``timeout_s``. The runner (probes/runner.py) turns an
exception or a timeout into status "error" and goes on with the next case:
"not measured" is never "passed".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from probes.context import ProbeContext


@dataclasses.dataclass(frozen=True)
class Outcome:
    status: str  # passed | warned | failed (waived and error are the runner's)
    reason: str | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Case:
    key: str
    description: str
    applicable: Callable[[ProbeContext], str | None]
    run: Callable[[ProbeContext], Outcome]
    timeout_s: Callable[[ProbeContext], float]
    order: int


_REGISTRY: dict[str, Case] = {}


def case(key: str, description: str, *, order: int, timeout_s: float | Callable[[ProbeContext], float],
         applicable: Callable[[ProbeContext], str | None] | None = None):
    """Register ``run`` as a case (decorator)."""

    def wrap(run: Callable[[ProbeContext], Outcome]) -> Callable[[ProbeContext], Outcome]:
        if key in _REGISTRY:
            raise ValueError(f"probe case {key!r} registered twice")
        timeout = timeout_s if callable(timeout_s) else (lambda _ctx, t=float(timeout_s): t)
        _REGISTRY[key] = Case(key, description, applicable or (lambda _ctx: None), run, timeout, order)
        return run

    return wrap


def registry() -> list[Case]:
    """Every case in run order (importing probes.all_cases registers them)."""
    import probes.all_cases  # noqa: F401 - registers the cases

    return sorted(_REGISTRY.values(), key=lambda c: c.order)


def needs_cards(ctx: ProbeContext) -> str | None:
    """Applicability shared by every measuring case: an NVIDIA card must be visible."""
    if ctx.nvml_problem:
        return ctx.nvml_problem
    if not ctx.cards:
        return "NVML sees no NVIDIA card on this host"
    return None


def needs_pairs(ctx: ProbeContext) -> str | None:
    why = needs_cards(ctx)
    if why:
        return why
    if len(ctx.cards) < 2:
        return "one card: there is no pair to measure"
    return None
