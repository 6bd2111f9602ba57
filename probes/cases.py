"""The one case protocol every probe follows, and the registry of cases.

A case has a stable ``key``, a one-line ``description``, ``applicable(ctx)``
returning the reason to waive it (or None), ``run(ctx)`` returning an
:class:`Outcome`, a ``timeout_s``, and ``needs``: the keys of the cases whose
findings it reads from the shared context (p2p reads the NVLink state the
inventory case records). The runner runs what a selected case needs first, so
``--only p2p`` alone still counts NVLinks. The runner (probes/runner.py) turns an
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
    needs: tuple[str, ...] = ()


_REGISTRY: dict[str, Case] = {}


def case(key: str, description: str, *, order: int, timeout_s: float | Callable[[ProbeContext], float],
         applicable: Callable[[ProbeContext], str | None] | None = None, needs: tuple[str, ...] = ()):
    """Register ``run`` as a case (decorator)."""

    def wrap(run: Callable[[ProbeContext], Outcome]) -> Callable[[ProbeContext], Outcome]:
        if key in _REGISTRY:
            raise ValueError(f"probe case {key!r} registered twice")
        timeout = timeout_s if callable(timeout_s) else (lambda _ctx, t=float(timeout_s): t)
        _REGISTRY[key] = Case(key, description, applicable or (lambda _ctx: None), run, timeout, order, tuple(needs))
        return run

    return wrap


def registry() -> list[Case]:
    """Every case in run order (importing probes.all_cases registers them)."""
    import probes.all_cases  # noqa: F401 - registers the cases

    cases = sorted(_REGISTRY.values(), key=lambda c: c.order)
    for c in cases:
        unknown = [n for n in c.needs if n not in _REGISTRY]
        later = [n for n in c.needs if n in _REGISTRY and _REGISTRY[n].order >= c.order]
        if unknown or later:
            raise ValueError(f"probe case {c.key!r} needs {unknown or later}: unknown, or ordered after it")
    return cases


def with_needs(selected: list[Case]) -> list[Case]:
    """``selected`` plus every case they need (transitively), in run order."""
    by_key = {c.key: c for c in registry()}
    keys: set[str] = set()
    todo = [c.key for c in selected]
    while todo:
        key = todo.pop()
        if key not in keys:
            keys.add(key)
            todo.extend(by_key[key].needs if key in by_key else ())
    extra = [by_key[k] for k in keys if k not in {c.key for c in selected}]
    return sorted([*selected, *extra], key=lambda c: c.order)


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
