"""qualify's phases around a run (LocalRun or HostRun): probe -> plan -> start -> accept -> report.

Each phase prints one line and lands in the report's `phases`; a phase that cannot run says why
(no GPU: nothing to plan, the demo model is served on CPU). Ctrl-C anywhere stops every process
qualify started and still returns a report, marked partial."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from v100plan import output
from v100plan.errors import V100planError

# qualify's default model when none is given: the hybrid class the field serves (engine/core/demo.py); a
# local run takes it with its MTP draft layer (LocalRun.demo_id), so one service runs speculation too
DEMO_ARCH, DEMO_ID = "qwen3_5", "v100plan-demo-hybrid"


class Phases:
    """The report's `phases` rows, each printed as it ends."""

    def __init__(self, show: bool):
        self.items: list[dict[str, Any]] = []
        self.show = show
        self.current: str | None = None
        self.t0 = 0.0

    def start(self, name: str, what: str) -> None:
        self.current, self.t0 = name, time.monotonic()
        if self.show:
            output.hint(f"== {name}: {what}")

    def end(self, status: str, detail: str) -> None:
        wall = round(time.monotonic() - self.t0, 3)
        self.items.append({"name": self.current, "status": status, "wall_s": wall, "detail": detail})
        if self.show:
            output.hint(f"   {self.current}: {status} ({wall:.1f} s) {detail}")
        self.current = None


def _probe(phases: Phases, run) -> dict | None:  # noqa: ANN001 - a LocalRun or a HostRun
    phases.start("probe", run.probe_what)
    try:
        doc = run.probe()
    except V100planError as e:
        if run.probe_fatal:
            raise  # the handler in qualify() ends the phase with the error
        phases.end("error", e.message)
        return None
    if doc["overall"] == "nothing_measured":
        why = next((c.get("reason") for c in doc["cases"] if c.get("reason")), "no card was measured")
        phases.end("waived", f"no NVIDIA GPU measured on {run.where}: {why}")
    else:
        phases.end({"passed": "passed", "warned": "warned"}.get(doc["overall"], "failed"),
                   f"{len(doc['cards'])} card(s) on {run.where}, overall {doc['overall']}")
    return doc


def accept_status(result: dict[str, Any]) -> str:
    """The accept phase's status from its scenarios: failed when one failed or errored (never "passed"
    beside failed scenarios), interrupted when the run stopped early, else passed (warnings included, as
    the verdict counts them)."""
    if any(s["status"] in ("failed", "error") for s in result["scenarios"]):
        return "failed"
    return "interrupted" if result.get("partial_reason") else "passed"


def note_plan_allreduce(plan: dict | None, notes: list[str]) -> None:
    """qualify serves with allreduce `auto` (the engine's own self-test and race); note what the plan said.

    The engine under test is two ranks (tp2) whatever the plan recommends, so a plan's launch path can name
    a strategy that is not served (replicas: 'none'); and where the plan's tp2 row names a path, the race
    measures the paths on these cards instead of trusting the prediction. The note says what the plan said."""
    launch = (plan or {}).get("launch") or {}
    tp2 = next((s for s in (plan or {}).get("strategies", []) if s.get("name") == "tp2"), None)
    if launch:
        said = f"the plan recommends {launch.get('strategy')} (allreduce {launch.get('allreduce')})"
        if tp2 is not None:
            said += f"; its tp2 row names {tp2.get('allreduce_path')}"
        notes.append(f"served as tp2 with allreduce auto (the engine's start-up race); {said}")


def _plan(phases: Phases, probe: dict | None, model_dir: Path) -> dict | None:
    phases.start("plan", "planning the served model on the measured cards")
    if not probe or not probe.get("cards"):
        phases.end("waived", "no GPU: the bundled engine serves on CPU, which the planner does not model")
        return None
    try:
        from v100plan.planning import plan_document

        doc = plan_document(probe, None, str(model_dir), "v100plan", "4K", None, 1, "latency")
    except V100planError as e:
        phases.end("warned", f"could not plan this model: {e.message}")
        return None
    phases.end("passed", f"recommended {doc.get('recommended')}")
    return doc


def qualify(out_dir: Path, model_dir: Path | None, opts, run, show: bool):  # noqa: ANN001
    """Returns (report, secrets to scrub, a V100planError to raise after writing or None)."""
    from v100plan.accept.runner import assemble, run_acceptance
    from v100plan.qualify.progress import Progress

    phases = Phases(show)
    given_model = model_dir
    t_all = time.monotonic()
    probe = plan = None
    result: dict[str, Any] | None = None
    partial = problem = None
    notes: list[str] = []
    engine: dict[str, Any] | None = None
    say = (lambda text: output.hint(f"   {text}")) if show else (lambda _text: None)
    try:
        probe = _probe(phases, run)
        if model_dir is None:
            model_dir = run.demo_model(out_dir)
            run.demo = True
            notes.append(f"no model given: the generated {run.demo_id} model (the hybrid class users serve: Gated "
                         "DeltaNet and gated attention layers as Qwen3.5, about 2.5 M parameters, random weights, "
                         "byte-identical on every machine) stands in for a real one")
        plan = _plan(phases, probe, model_dir)
        phases.start(run.start_name, run.start_what)
        target, engine, detail = run.start(model_dir, probe, plan, notes, say)
        phases.end("passed", detail)
        phases.start("accept", "functional scenarios, each fault "
                               f"{opts.fault_repeats} times, {opts.requests} requests from {opts.clients} clients")
        with Progress(enabled=show) as progress:
            result = run_acceptance(target, opts, plan=plan, probe=probe, progress=progress)
        partial = result.get("partial_reason")
        counts = ", ".join(f"{n} {st}" for st in ("passed", "warned", "failed", "error", "waived")
                           if (n := sum(s["status"] == st for s in result["scenarios"])))
        phases.end(accept_status(result), f"{len(result['scenarios'])} scenarios ({counts or 'none ran'})")
    except KeyboardInterrupt:
        partial = f"interrupted (Ctrl-C) during {phases.current or 'qualify'}"
        if phases.current:
            phases.end("interrupted", "Ctrl-C")
    except V100planError as e:
        partial = f"the {phases.current or 'start'} phase failed: {e.message.splitlines()[0]}"
        problem = e
        if phases.current:
            phases.end("error", e.message.splitlines()[0])
    finally:
        run.finish(out_dir, phases)
    if result is None:
        result = {"scenarios": [], "load": None, "notes": notes, "partial_reason": partial,
                  "target": {"mode": run.mode, "endpoint": run.endpoint, "host": run.inputs.get("host"),
                             "model": str(given_model) if given_model else run.demo_id, "server": None,
                             "fault_control": False, "engine": engine, "notes": notes}}
    report = assemble(result, phases=phases.items + [{"name": "report", "status": "passed", "wall_s": 0.0,
                                                       "detail": f"written to {out_dir}"}],
                      probe=probe, plan=plan, inputs={"mode": run.mode, "device": run.device,
                                                      **run.inputs,
                                                      "model": str(given_model) if given_model else "demo",
                                                      "clients": opts.clients, "requests": opts.requests,
                                                      "repeats": opts.fault_repeats},
                      wall_s=time.monotonic() - t_all, partial_reason=partial)
    return report, run.secrets, problem
