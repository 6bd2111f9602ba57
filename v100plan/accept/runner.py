"""Runs the cases in order and assembles the AcceptanceReport document.

functional -> fault -> load: the load runs last, on a service that has just been through
every fault, so it also shows the service came back whole."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from probes.case_runner import STATUSES, Ran, run_contained, waiver
from profiles.document import SCHEMA_VERSIONS, provenance, utc_now
from v100plan.accept import plan_vs_measured as pvm
from v100plan.accept.cases import Case, Outcome, registry, spread
from v100plan.accept.context import PROMPTS, REF_TOKENS, AcceptOptions, Context, Target
from v100plan.accept.faults import size_fault_request

GROUP_ORDER = ("functional", "fault", "load")
Progress = Callable[[str, dict[str, Any]], None]   # (event, fields): "case_start" / "case_end" / "note"


class Interrupted(Exception):
    """Ctrl-C during the run: the report is written, marked partial."""


def _selected(c: Case, opts: AcceptOptions) -> str | None:
    """The reason a case is not run by the user's choice, or None."""
    if opts.only and c.key not in opts.only and c.group not in opts.only:
        return f"not selected (--only {','.join(opts.only)})"
    if c.key in opts.skip or c.group in opts.skip:
        return "skipped by the user (--skip)"
    return None


def _scenario(c: Case, status: str, outcome: Outcome | None, reason: str | None, duration: float | None,
              started_utc: str | None = None) -> dict:
    doc: dict[str, Any] = {"key": c.key, "description": c.description, "group": c.group, "status": status,
                           "reason": reason, "duration_s": None if duration is None else round(duration, 3),
                           "started_utc": started_utc or utc_now(),
                           "evidence": outcome.evidence if outcome else []}
    if outcome is not None:
        if outcome.repetitions:
            doc["repetitions"] = [r.to_dict() for r in outcome.repetitions]
            doc["time_to_detect_s"] = spread([r.time_to_detect_s for r in outcome.repetitions])
            doc["time_to_recover_s"] = spread([r.time_to_recover_s for r in outcome.repetitions])
        doc["metrics"] = {k: v for k, v in outcome.metrics.items()
                          if k not in ("time_to_detect_s", "time_to_recover_s")}
    return doc


def _reference_keys(ctx: Context, cases: list[Case]) -> list[tuple]:
    keys: list[tuple] = [(p, REF_TOKENS) for p in PROMPTS.values()] + [(PROMPTS["story"], 32)]
    keys += [(p, ctx.options.load_max_tokens) for p in PROMPTS.values()]
    if ctx.refs.exact:
        keys.append((PROMPTS["once"], REF_TOKENS, 0.9, 4242))
    if any(c.group == "fault" for c in cases):
        keys.append((PROMPTS["story"], ctx.fault_tokens))
    return sorted({(k + (0.0, None))[:4] for k in keys}, key=str)


def run_acceptance(target: Target, options: AcceptOptions, *, plan: dict | None = None,
                   probe: dict | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Run every selected case against `target`; return the scenarios, the load figures and notes.

    Raises ConnectionError when the service cannot be reached at all (nothing to accept)."""
    say = progress or (lambda _event, _fields: None)
    ctx = Context(target, options, plan=plan, probe=probe)
    scenarios: list[dict] = []
    partial_reason = None
    try:
        notes = list(target.notes) + ctx.discover()
        cases = sorted(registry(), key=lambda c: GROUP_ORDER.index(c.group))
        plan_to_run = []
        for c in cases:
            chosen = _selected(c, options)
            plan_to_run.append((c, Ran("waived", chosen) if chosen else waiver(c, ctx)))
        runnable = [c for c, skip in plan_to_run if skip is None]
        if any(c.group == "fault" for c in runnable):
            notes.append(size_fault_request(ctx))
        if any(c.group != "functional" or c.key in ("completion", "tp2_equals_tp1") for c in runnable):
            say("note", {"text": f"computing reference answers ({'engine TP1 runs' if ctx.refs.exact else 'service baseline'})"})
            try:
                ctx.refs.prefetch(_reference_keys(ctx, runnable))
            except KeyboardInterrupt:
                raise Interrupted("interrupted while computing references") from None
        for c, skip in plan_to_run:
            if skip is not None:  # waived, or its applicability check broke ("error")
                scenarios.append(_scenario(c, skip.status, None, skip.reason, None))
                say("case_end", scenarios[-1])
                continue
            say("case_start", {"key": c.key, "description": c.description, "group": c.group})
            started = utc_now()
            try:
                ran = run_contained(c, ctx)
            except KeyboardInterrupt:
                partial_reason = f"interrupted (Ctrl-C) during {c.key}"
                break
            scenarios.append(_scenario(c, ran.status, ran.outcome, ran.reason, ran.duration_s, started))
            say("case_end", scenarios[-1])
        compared = _plan_vs_measured(ctx, plan, target, partial_reason)
    except Interrupted as exc:
        partial_reason = str(exc)
        notes = list(target.notes)
        compared = pvm.empty(f"not measured: {partial_reason}")
    finally:
        if ctx.is_engine and ctx.speculation is not None:
            ctx.note_speculation()  # the acceptance rate over the scenarios' requests
        ctx.close()
    return {"scenarios": scenarios, "load": ctx.shared.get("load"), "notes": notes,
            "partial_reason": partial_reason, "plan_vs_measured": compared,
            "target": {"mode": target.mode, "endpoint": target.endpoint, "host": target.host,
                       "model": ctx.model or (target.model or "unknown"), "server": ctx.server,
                       "fault_control": ctx.fault_control, "decode": ctx.decode, "limits": ctx.limits,
                       "speculation": ctx.speculation, "concurrency": ctx.shared.get("concurrency"),
                       "engine": {**target.engine, "max_context": ctx.max_context} if target.engine else None,
                       "notes": notes}}


def _plan_vs_measured(ctx: Context, plan: dict | None, target: Target, partial_reason: str | None) -> dict:
    """The plan against this run's measurements (v100plan/accept/plan_vs_measured.py), after the scenarios."""
    if partial_reason:
        return pvm.empty(f"not measured: {partial_reason}")
    devices = (target.engine or {}).get("devices")
    gpu = None if not devices else any(str(d).startswith("cuda") for d in devices)
    try:
        return pvm.section(ctx, plan, gpu=gpu)
    except KeyboardInterrupt:
        raise Interrupted("interrupted while measuring the plan's figures") from None
    except Exception as e:  # noqa: BLE001 - a failed measurement is said in the report, never a lost run
        return pvm.empty(f"the measurement failed: {type(e).__name__}: {e}")


def summarize(scenarios: list[dict]) -> dict[str, int]:
    counts = {s: 0 for s in STATUSES}
    for sc in scenarios:
        counts[sc["status"]] += 1
    return counts


def verdict(scenarios: list[dict], partial_reason: str | None) -> tuple[str, str]:
    counts = summarize(scenarios)
    bad = [sc["key"] for sc in scenarios if sc["status"] in ("failed", "error")]
    if bad:
        return "failed", f"{len(bad)} scenario(s) failed or errored: {', '.join(bad)}"
    if partial_reason:
        return "incomplete", f"the run stopped early: {partial_reason}"
    ran = counts["passed"] + counts["warned"]
    if ran == 0:
        return "incomplete", "no scenario ran (all waived)"
    return "passed", (f"all {ran} scenarios that ran passed" + (f" ({counts['warned']} with warnings)"
                                                                if counts["warned"] else "")
                      + (f"; {counts['waived']} waived" if counts["waived"] else ""))


def assemble(result: dict[str, Any], *, phases: list[dict], probe: dict | None, plan: dict | None,
             inputs: dict[str, Any], wall_s: float | None, partial_reason: str | None = None) -> dict[str, Any]:
    """The AcceptanceReport document (profiles/schema/acceptance_report.schema.json)."""
    partial_reason = partial_reason or result.get("partial_reason")
    v, why = verdict(result["scenarios"], partial_reason)
    doc = {
        "kind": "acceptance_report", "schema_version": SCHEMA_VERSIONS["acceptance_report"],
        "provenance": provenance(inputs, method={
            "faults": "each fault lands on a streamed request after its second token; detect = injection -> "
                      "first error event or /health not 200; recover = injection -> first exact answer",
            "references": "the engine's TP1 run on the same weights when they are local, else the "
                          "service's own first greedy answer"}),
        "verdict": v, "verdict_reason": why, "partial": partial_reason is not None,
        "partial_reason": partial_reason, "wall_s": None if wall_s is None else round(wall_s, 3),
        "target": result["target"], "summary": summarize(result["scenarios"]), "phases": phases,
        "scenarios": result["scenarios"], "load": result.get("load"), "probe": probe, "plan": plan,
        "plan_vs_measured": result.get("plan_vs_measured") or pvm.empty("no acceptance run: nothing was measured"),
    }
    return doc
