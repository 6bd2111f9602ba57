"""Runs probe cases one after another through the shared case runner (probes/case_runner.py): each
case contained, an exception (in applicable() too) or a timeout becomes status "error" for that case and
the next case still runs. A case's ``needs`` run first, even when only the case itself was selected
(their results are in the report too)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from probes.case_runner import STATUSES, run_case
from probes.cases import Case, with_needs
from probes.context import ProbeContext
from probes.report import CaseResult

Event = Callable[[dict[str, Any]], None]


def run_cases(cases: list[Case], ctx: ProbeContext, on_event: Event | None = None) -> list[CaseResult]:
    results: list[CaseResult] = []
    emit = on_event or (lambda _e: None)
    cases = with_needs(cases)
    for i, case in enumerate(cases):
        emit({"event": "start", "key": case.key, "description": case.description, "index": i, "total": len(cases)})
        ran = run_case(case, ctx)
        details = dict(ran.outcome.details) if ran.outcome is not None else {}
        result = CaseResult(case.key, case.description, ran.status, ran.reason, ran.duration_s, details)
        assert result.status in STATUSES
        results.append(result)
        emit({"event": "end", "key": case.key, "status": result.status, "reason": result.reason,
              "duration_s": result.duration_s, "index": i, "total": len(cases)})
    return results
