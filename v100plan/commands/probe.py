"""`v100plan probe`: measure this host's cards (python -m probes), name each variant, judge it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from v100plan import catalogue, documents, output, probe_judge, probe_run
from v100plan.commands.remote_options import RemoteArgs, remote_options
from v100plan.errors import BadInput, ChecksFailed, DocumentError, NothingMeasured
from v100plan.options import JsonOpt, OutOpt, QuietOpt

QuickOpt = Annotated[bool, typer.Option("--quick", help="A short load (4-10 s, until power is steady) and fewer repeats.")]
SoakOpt = Annotated[Optional[float], typer.Option("--soak", metavar="S", help="Soak: load the cards for S seconds (default: no soak; the standard load is 30 s).")]
DurationOpt = Annotated[Optional[float], typer.Option("--duration", metavar="S",
                                                      help="Load duration of the throttle case in seconds (default: 30; with --quick 4-10 s, until power is steady).")]
OnlyOpt = Annotated[Optional[str], typer.Option("--only", help="Comma-separated case keys (see python -m probes --list); the cases they need run too (default: every case).")]
HostsOpt = Annotated[Optional[list[str]], typer.Option("--host", metavar="USER@HOST[:PORT]",
                                                       help="Probe this host over SSH (repeat for several).")]
InventoryOpt = Annotated[Optional[str], typer.Option("--inventory", metavar="FILE",
                                                     help="Probe every host listed in FILE (one a line).")]
MaxFailOpt = Annotated[int, typer.Option("--max-fail", metavar="N",
                                         help="Hosts that may fail to be probed before the command fails.")]
FromOpt = Annotated[Optional[Path], typer.Option("--from", help="Judge a recorded ProbeReport instead of measuring (default: measure this host).")]


def measure_or_load(quick: bool, soak: float | None, duration: float | None, only: str | None,
                    from_file: Path | None, show_progress: bool) -> dict[str, Any]:
    """The ProbeReport: loaded from ``from_file``, else measured now with a progress display."""
    if from_file is not None:
        return documents.load(from_file, "probe_report")
    if soak is not None and quick:
        raise BadInput("--quick and --soak contradict each other", hint="give one: --quick, or --soak 600")
    for name, v in (("--soak", soak), ("--duration", duration)):
        if v is not None and v <= 0:
            raise BadInput(f"{name} must be a positive number of seconds, got {v}", hint=f"e.g. {name} 60")
    load_s = soak or duration or (15.0 if quick else 30.0)
    with output.progress(enabled=show_progress) as bar:
        tasks: dict[str, Any] = {}

        def on_event(e: dict[str, Any]) -> None:
            if e["event"] == "start":
                tasks[e["key"]] = bar.add_task(f"[{e['index'] + 1}/{e['total']}] {e['description']}", total=1)
            elif e["event"] == "end" and e["key"] in tasks:
                bar.update(tasks[e["key"]], completed=1,
                           description=f"[{e['index'] + 1}/{e['total']}] {e['key']}: {e['status']}")

        return probe_run.run(probe_run.probe_args(quick, soak, duration, only), on_event,
                             timeout_s=load_s + 900)


def hardware_catalogue() -> tuple[list[dict[str, Any]], list[str]]:
    """Every readable hardware profile, and a note for each that could not be read (never fatal here:
    an unreadable profile only means its cards get generic expectations)."""
    profiles, problems = [], []
    for id_ in catalogue.ids("hardware"):
        try:
            profiles.append(catalogue.get("hardware", id_))
        except DocumentError as e:
            problems.append(f"{id_}: {e.message}")
    return profiles, problems


def verdict_tables(judgement: probe_judge.Judgement, report: dict[str, Any]) -> list[Any]:
    """The verdict table and the case table, as renderables (golden-tested at a fixed width)."""
    rows = [(r.subject, r.check, r.status, r.detail) for r in judgement.rows]
    cases = [(c["key"], c["status"], f"{c['duration_s']:.1f}", c.get("reason") or "") for c in report["cases"]]
    return [
        output.table("Verdicts", ["subject", "check", "status", "detail"], rows),
        output.table("Probe cases", ["case", "status", ("s", "right"), "reason"], cases,
                     caption=f"overall: {report['overall']}, {report.get('wall_s', 0):.1f} s"),
    ]


def render_verdicts(judgement: probe_judge.Judgement, report: dict[str, Any], to_stderr: bool) -> None:
    for t in verdict_tables(judgement, report):
        output.render(t, to_stderr=to_stderr)


def register(app: typer.Typer) -> None:
    @app.command("probe")
    @remote_options(command_timeout=1800.0, deployment=None)
    def probe(
        quick: QuickOpt = False,
        soak: SoakOpt = None,
        duration: DurationOpt = None,
        only: OnlyOpt = None,
        from_file: FromOpt = None,
        json_out: JsonOpt = False,
        out: OutOpt = None,
        quiet: QuietOpt = False,
        hosts: HostsOpt = None,
        inventory: InventoryOpt = None,
        max_fail: MaxFailOpt = 0,
        remote: RemoteArgs = None,
    ) -> None:
        """Measure every card and pair on this host (or on --host/--inventory hosts over SSH), name each
        card's variant and judge it.

        Exit codes: 0 everything passed or warned, 1 a check failed or errored, 3 nothing could be
        measured (no NVIDIA driver, or every case waived).
        """
        if hosts or inventory:  # over SSH, in parallel: v100plan.commands.probe_remote
            from v100plan.extras import require

            require("deploy", "`v100plan probe --host`")  # a package missing HERE is not the host being down
            from v100plan.commands import probe_remote

            if from_file is not None:
                raise BadInput("--from judges a recorded report; it cannot be combined with --host/--inventory",
                               hint="drop --from to probe the hosts, or drop --host to judge the file")
            return probe_remote.run(hosts, inventory, max_fail, probe_run.probe_args(quick, soak, duration, only),
                                    remote.ssh, remote.settings(), json_out, out, quiet)
        output.check_out(out)  # before measuring: a GPU host's run is never lost to a bad path
        report = measure_or_load(quick, soak, duration, only, from_file, show_progress=not quiet)
        hardware, problems = hardware_catalogue()
        judgement = probe_judge.judge(report, hardware, catalogue_problems=problems)
        doc = judgement.report
        doc["verdicts"] = judgement.to_dict()["rows"]
        output.write_json(out, doc, indent=1)
        if json_out:
            output.emit_json(doc)
        if not quiet:
            render_verdicts(judgement, doc, to_stderr=json_out)
        if probe_judge.nothing_measured(doc):
            no_driver = (doc["host"].get("unavailable") or {}).get("gpu_count")
            raise NothingMeasured(
                f"nothing could be measured: {no_driver}" if no_driver else
                "nothing could be measured: every probe case was waived",
                hint="run `v100plan probe` on the GPU host itself (or check `nvidia-smi` there)")
        failed = [r for r in judgement.rows if r.status == "failed"]
        if failed or doc["overall"] == "failed":
            what = "; ".join(f"{r.subject} {r.check}: {r.detail}" for r in failed[:3])
            raise ChecksFailed(f"{len(failed)} check(s) failed: {what}" if failed else "a probe case failed",
                               hint="the verdict table above says which and why; --json has the raw figures")
