"""The one case protocol and its runner, for the probes and the acceptance suite alike (stdlib only:
v100plan/accept imports this module, and probes/ never imports v100plan).

A case has a stable ``key``, a one-line ``description``, ``applicable(ctx)`` returning the reason to
waive it (or None), ``run(ctx)`` returning an outcome with a ``status`` (passed, warned or failed) and a
``reason``, and ``timeout_s(ctx)``. The runner contains every error per case: an exception raised by
``applicable()`` or ``run()``, a run past its timeout, or a run that returns something else than an
outcome, each becomes status "error" with the reason, and the next case still runs. A waived case is
never "passed" (after nvbandwidth's testcase structure)."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Protocol

STATUSES = ("passed", "warned", "failed", "waived", "error")
OUTCOME_STATUSES = ("passed", "warned", "failed")  # what run() may say; waived and error are the runner's


class Case(Protocol):
    key: str
    description: str

    def applicable(self, ctx: Any) -> str | None: ...

    def run(self, ctx: Any) -> Any: ...

    def timeout_s(self, ctx: Any) -> float: ...


@dataclasses.dataclass(frozen=True)
class Ran:
    """What became of one case: its status and reason, the outcome run() returned (None when it was
    waived or errored) and the seconds it took."""

    status: str
    reason: str | None
    outcome: Any = None
    duration_s: float = 0.0


def waiver(case: Case, ctx: Any) -> Ran | None:
    """The case's applicability: a "waived" Ran with the reason, an "error" Ran when the check itself
    raised (a broken check must not look like "not applicable"), or None when the case applies."""
    try:
        why = case.applicable(ctx)
    except Exception as e:  # noqa: BLE001 - contained per case by design
        return Ran("error", f"its applicability check raised {type(e).__name__}: {e}")
    return None if why is None else Ran("waived", str(why))


def run_contained(case: Case, ctx: Any) -> Ran:
    """Run ``case.run(ctx)`` in a daemon worker thread, bounded by its timeout.

    A daemon thread: a GPU call or a request that never returns cannot be interrupted from Python, but it
    must not stop the report from being written either. Short joins keep Ctrl-C responsive in the caller
    (its KeyboardInterrupt propagates; the worker is left behind)."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["outcome"] = case.run(ctx)
        except BaseException as e:  # noqa: BLE001 - contained per case by design
            box["error"] = f"{type(e).__name__}: {e}"

    t0 = time.monotonic()
    try:
        timeout = float(case.timeout_s(ctx))
    except Exception as e:  # noqa: BLE001
        return Ran("error", f"its timeout could not be computed: {type(e).__name__}: {e}")
    worker = threading.Thread(target=work, name=f"case-{case.key}", daemon=True)
    worker.start()
    deadline = t0 + timeout
    while worker.is_alive() and time.monotonic() < deadline:
        worker.join(min(0.2, max(0.0, deadline - time.monotonic())))
    took = round(time.monotonic() - t0, 3)
    if worker.is_alive():
        return Ran("error", f"did not finish within its {timeout:g} s timeout; the cases after it still ran",
                   duration_s=took)
    if "error" in box:
        return Ran("error", f"the case itself broke: {box['error']}", duration_s=took)
    outcome = box.get("outcome")
    status = getattr(outcome, "status", None)
    if status not in OUTCOME_STATUSES:
        return Ran("error", f"the case returned {outcome!r} instead of an outcome that passed, warned or failed",
                   duration_s=took)
    return Ran(status, getattr(outcome, "reason", None), outcome, took)


def run_case(case: Case, ctx: Any) -> Ran:
    """Applicability, then the run: every way a case can go wrong is its own "error", never the runner's."""
    t0 = time.monotonic()
    waived = waiver(case, ctx)
    if waived is not None:
        return dataclasses.replace(waived, duration_s=round(time.monotonic() - t0, 3))
    return run_contained(case, ctx)
