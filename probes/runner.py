"""Runs cases one after another, each contained: an exception or a timeout becomes status
"error" for that case and the next case still runs. A case's ``needs`` run first, even when
only the case itself was selected (their results are in the report too)."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from probes.cases import Case, Outcome, with_needs
from probes.context import ProbeContext
from probes.report import STATUSES, CaseResult

Event = Callable[[dict[str, Any]], None]


def _run_contained(case: Case, ctx: ProbeContext, timeout_s: float) -> tuple[Outcome | None, str | None]:
    """Run ``case`` in a worker thread; (outcome, None) or (None, why it errored)."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["outcome"] = case.run(ctx)
        except BaseException as e:  # noqa: BLE001 - contained per case by design
            box["error"] = f"{type(e).__name__}: {e}"
            box["trace"] = traceback.format_exc(limit=6)

    # A daemon thread: a GPU call that never returns cannot be interrupted from Python,
    # but it must not stop the report from being written either.
    worker = threading.Thread(target=work, name=f"probe-{case.key}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return None, f"did not finish within {timeout_s:.0f} s (timeout); the cases after it still ran"
    if "error" in box:
        return None, box["error"]
    outcome = box.get("outcome")
    if not isinstance(outcome, Outcome) or outcome.status not in ("passed", "warned", "failed"):
        return None, f"case returned {outcome!r} instead of an Outcome with passed/warned/failed"
    return outcome, None


def run_cases(cases: list[Case], ctx: ProbeContext, on_event: Event | None = None) -> list[CaseResult]:
    results: list[CaseResult] = []
    emit = on_event or (lambda _e: None)
    cases = with_needs(cases)
    for i, case in enumerate(cases):
        emit({"event": "start", "key": case.key, "description": case.description, "index": i, "total": len(cases)})
        t0 = time.perf_counter()
        try:
            waive = case.applicable(ctx)
        except Exception as e:  # noqa: BLE001 - a broken check must not look like "not applicable"
            waive, outcome, error = None, None, f"applicability check raised {type(e).__name__}: {e}"
        else:
            outcome, error = (None, None)
            if waive is None:
                outcome, error = _run_contained(case, ctx, case.timeout_s(ctx))
        if waive is not None:
            result = CaseResult(case.key, case.description, "waived", waive, round(time.perf_counter() - t0, 3))
        elif error is not None:
            result = CaseResult(case.key, case.description, "error", error, round(time.perf_counter() - t0, 3))
        else:
            assert outcome is not None  # _run_contained returns one of the two
            result = CaseResult(case.key, case.description, outcome.status, outcome.reason,
                                round(time.perf_counter() - t0, 3), dict(outcome.details))
        assert result.status in STATUSES
        results.append(result)
        emit({"event": "end", "key": case.key, "status": result.status, "reason": result.reason,
              "duration_s": result.duration_s, "index": i, "total": len(cases)})
    return results
