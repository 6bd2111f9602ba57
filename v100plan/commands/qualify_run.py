"""`qualify`'s phases: probe -> plan -> start the bundled service -> accept -> report.

Each phase prints one line and lands in the report's `phases`; a phase that cannot run says why
(no GPU: nothing to plan, the demo model is served on CPU). Ctrl-C anywhere stops every process
qualify started and still returns a report, marked partial.

Where the service runs is a "run" object: ``LocalRun`` here (this machine), ``HostRun`` in
qualify_host.py (a host over SSH). Both probe, serve the model, hand the acceptance suite its
target and clean up; the phases around them are the same code."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from v100plan import output
from v100plan.errors import V100planError


class _Phases:
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


def _probe(phases: _Phases, run) -> dict | None:  # noqa: ANN001 - a LocalRun or a HostRun
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


def _devices(device: str, probe: dict | None) -> str:
    if device != "auto":
        return device
    cards = len(probe["cards"]) if probe else 0
    return "cuda" if cards >= 2 else ("cuda:0,cuda:0" if cards == 1 else "cpu")


def _dtype(devices: str, probe: dict | None, plan: dict | None, demo: bool = False) -> str:
    # The demo model is there to check answers token for token against a TP1 run, which holds only in
    # float32: in half precision TP2's split sums round differently from one card's, and the demo
    # model's random weights give near-flat logits where that flips an argmax (seen on two H200s).
    if devices == "cpu" or demo:
        return "float32"
    launch = (plan or {}).get("launch") or {}
    if launch.get("dtype") in ("float16", "bfloat16"):
        return launch["dtype"]
    # No plan: the cards decide (bf16 needs compute capability 8.0; a V100 is 7.0).
    caps = [c.get("compute_capability") for c in (probe or {}).get("cards", [])]
    return "bfloat16" if caps and all(c and float(c) >= 8.0 for c in caps) else "float16"


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


def _plan(phases: _Phases, probe: dict | None, model_dir: Path, out_dir: Path) -> dict | None:
    phases.start("plan", "planning the served model on the measured cards")
    if not probe or not probe.get("cards"):
        phases.end("waived", "no GPU: the bundled engine serves on CPU, which the planner does not model")
        return None
    try:
        from v100plan.commands.planning import plan_document

        probe_file = out_dir / "probe.json"
        probe_file.write_text(json.dumps(probe, indent=1))
        doc = plan_document(str(probe_file), None, str(model_dir), "v100plan", "4K", None, 1, "latency")
    except V100planError as e:
        phases.end("warned", f"could not plan this model: {e.message}")
        return None
    phases.end("passed", f"recommended {doc.get('recommended')}")
    return doc


class LocalRun:
    """qualify on this machine: `python -m probes` here, the engine under its supervisor here."""

    mode, where = "local", "this machine"
    probe_what = "measuring this machine's cards (python -m probes --quick)"
    probe_fatal = False
    start_name, start_what = "start", "starting the bundled engine under its supervisor"

    def __init__(self, device: str):
        self.device = device
        self.demo = False  # set when qualify generated the demo model
        self.svc = None
        self.secrets: list[str] = []
        self.endpoint = "not started"
        self.inputs: dict[str, Any] = {}

    def probe(self) -> dict:
        from v100plan import probe_run

        return probe_run.run(probe_run.probe_args(True, None, None, None), lambda _e: None, timeout_s=900)

    def demo_model(self, out_dir: Path) -> Path:
        from v100plan.accept.local import make_demo_model

        return make_demo_model(out_dir / "demo-model")

    def start(self, model_dir: Path, probe: dict | None, plan: dict | None, notes: list[str], say):  # noqa: ANN001, ANN201
        """Start the service; returns (the acceptance suite's Target, the engine's launch settings, a detail)."""
        from v100plan.accept.context import Target
        from v100plan.accept.local import LocalService

        devices = _devices(self.device, probe)
        dtype = _dtype(devices, probe, plan, demo=self.demo)
        note_plan_allreduce(plan, notes)
        if self.demo and devices != "cpu":
            notes.append("the demo model is served in float32 on the GPUs too, so its answers can be compared "
                         "token for token with a TP1 run; speeds are not a half-precision model's")
        if devices == "cpu":
            notes.append("no GPU: both ranks run on CPU (float32, gloo or the host mailbox); speeds are not "
                         "a GPU's and no plan applies")
        # The service's own limits, as deploy deploys them (no qualify-only watchdog flags): the report's
        # target.limits records them from its /health.
        self.svc = svc = LocalService(model_dir, devices=devices, dtype=dtype, allreduce="auto")
        self.secrets.append(svc.api_key)
        self.endpoint = svc.endpoint
        svc.start()
        health = svc.health()
        engine = {"tp": 2, "devices": list(("cpu", "cpu") if devices == "cpu" else
                                           (("cuda:0", "cuda:1") if devices == "cuda" else devices.split(","))),
                  "dtype": dtype, "allreduce": health.get("allreduce"), "max_context": None}
        target = Target(endpoint=svc.endpoint, api_key=svc.api_key, mode="local", model_dir=str(model_dir),
                        engine=engine, supervised=True, read_rank_logs=svc.read_rank_logs,
                        read_service_log=svc.read_service_log, notes=notes)
        return target, engine, f"{svc.endpoint}, allreduce {engine['allreduce']}, devices {','.join(engine['devices'])}"

    def finish(self, out_dir: Path, phases: _Phases) -> None:
        """Stop every process the service started, keep its logs next to the report."""
        if self.svc is None:
            return
        try:
            self.svc.stop()
        except Exception:  # noqa: BLE001 - stopping must not hide the run's own outcome
            pass
        self.svc.keep_logs(out_dir / "logs")
        self.svc.remove()


def qualify(out_dir: Path, model_dir: Path | None, opts, run, show: bool):  # noqa: ANN001
    """Returns (report, secrets to scrub, a V100planError to raise after writing or None)."""
    from v100plan.accept.runner import assemble, run_acceptance
    from v100plan.commands.accept import _Progress

    phases = _Phases(show)
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
            notes.append("no model given: the generated v100plan-demo model (about 3.3 M parameters, random "
                         "weights, byte-identical on every machine) stands in for a real one")
        plan = _plan(phases, probe, model_dir, out_dir)
        phases.start(run.start_name, run.start_what)
        target, engine, detail = run.start(model_dir, probe, plan, notes, say)
        phases.end("passed", detail)
        phases.start("accept", "functional scenarios, each fault "
                               f"{opts.fault_repeats} times, {opts.requests} requests from {opts.clients} clients")
        with _Progress(enabled=show) as progress:
            result = run_acceptance(target, opts, plan=plan, probe=probe, progress=progress)
        partial = result.get("partial_reason")
        phases.end("interrupted" if partial else "passed", f"{len(result['scenarios'])} scenarios")
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
                             "model": str(given_model) if given_model else "v100plan-demo", "server": None,
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
