"""`v100plan accept` (any OpenAI-compatible endpoint) and `v100plan qualify` (the main job:
probe -> plan -> start the bundled service -> accept -> report)."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from v100plan import documents, output
from v100plan.api_key import read_api_key
from v100plan.commands.remote_options import IndexUrlOpt, RemoteArgs, TorchOpt, option_group, remote_options
from v100plan.errors import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, BadInput, EnvironmentProblem
from v100plan.options import JsonOpt

OutDirOpt = Annotated[Optional[Path], typer.Option(
    "--out", "-o", help="Directory for report.json, report.html, junit.xml and the service logs "
                        "(default: ./v100plan-report).")]
ClientsOpt = Annotated[int, typer.Option("--clients", min=1, max=256, help="Concurrent clients in the load scenario.")]
RequestsOpt = Annotated[int, typer.Option("--requests", min=0, max=100000,
                                          help="Requests in all in the load scenario (0 waives it).")]
RepeatsOpt = Annotated[int, typer.Option("--repeats", min=1, max=50, help="Repetitions of each injected fault.")]
OnlyOpt = Annotated[Optional[str], typer.Option(
    "--only", help="Comma-separated scenario keys or groups (functional, fault, load) to run; the rest are waived.")]
SkipOpt = Annotated[Optional[str], typer.Option("--skip", help="Comma-separated scenario keys or groups to waive.")]
PlanOpt = Annotated[Optional[Path], typer.Option("--plan", help="A Plan JSON: its predicted decode speed is set "
                                                                "against the served one.")]
ProbeOpt = Annotated[Optional[Path], typer.Option("--probe-report", help="A ProbeReport JSON to embed in the report.")]

DEFAULT_OUT = Path("v100plan-report")
QUALIFY_PORT = 8100  # qualify --host's own service port on the host (a production deploy defaults to 8000)


@dataclass(frozen=True)
class Suite:
    """The acceptance suite's options as given (accept and qualify take the same ones)."""

    clients: int
    requests: int
    repeats: int
    only: str | None
    skip: str | None
    out: Path | None
    json_out: bool

    def inputs(self) -> dict[str, Any]:
        """What the report records of them."""
        return {"clients": self.clients, "requests": self.requests, "repeats": self.repeats, "only": self.only,
                "skip": self.skip}


suite_options = option_group("suite", {
    "clients": (ClientsOpt, 16), "requests": (RequestsOpt, 200), "repeats": (RepeatsOpt, 3), "only": (OnlyOpt, None),
    "skip": (SkipOpt, None), "out": (OutDirOpt, None), "json_out": (JsonOpt, False)}, lambda got: Suite(**got))


def _csv(text: str | None) -> tuple[str, ...]:
    return tuple(p.strip() for p in (text or "").split(",") if p.strip())


def _known_keys(values: tuple[str, ...], option: str) -> None:
    from v100plan.accept.cases import registry

    known = {c.key for c in registry()} | {"functional", "fault", "load"}
    unknown = [v for v in values if v not in known]
    if unknown:
        raise BadInput(f"{option}: unknown scenario {', '.join(map(repr, unknown))}",
                       hint=f"choose from {', '.join(sorted(known))}")




def _prepare_out(out: Path | None) -> Path:
    out = out or DEFAULT_OUT
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {str(out)!r} is a file; the reports need a directory", hint="give --out a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"--out {str(out)!r} cannot be created: {e.strerror or e}",
                       hint="give --out a directory you can write") from None
    if not os.access(out, os.W_OK):
        raise BadInput(f"--out {str(out)!r} is not writable", hint="give --out a directory you can write")
    return out


def _options(suite: Suite):
    from v100plan.accept.context import AcceptOptions

    o, s = _csv(suite.only), _csv(suite.skip)
    _known_keys(o, "--only")
    _known_keys(s, "--skip")
    if suite.requests == 0:
        s = s + ("load",)
    return AcceptOptions(clients=suite.clients, requests=suite.requests, fault_repeats=suite.repeats, only=o, skip=s)


def _need_accept_deps() -> None:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise EnvironmentProblem("the acceptance suite needs httpx, which is not installed",
                                 "pip install 'v100plan[accept]'") from None


class _Progress:
    """One line per scenario on stderr, a spinner while it runs."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar_cm = output.progress(enabled=enabled)
        self.bar = None
        self.task = None
        self.n = 0

    def __enter__(self):
        self.bar = self.bar_cm.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bar_cm.__exit__(*exc)

    def __call__(self, event: str, fields: dict[str, Any]) -> None:
        if event == "note":
            self.bar.console.print(f"  {fields['text']}", markup=False)
        elif event == "case_start":
            self.n += 1
            self.task = self.bar.add_task(f"{fields['group']:<10} {fields['key']}", total=1)
        elif event == "case_end":
            dur = f"{fields['duration_s']:.1f} s" if fields.get("duration_s") is not None else ""
            line = f"{fields['group']:<10} {fields['key']:<18} {fields['status']:<7} {dur}"
            if fields["status"] != "passed" and fields.get("reason"):
                line += f"  {fields['reason'][:150]}"
            if self.task is not None:
                self.bar.remove_task(self.task)
                self.task = None
            self.bar.console.print(line, markup=False)


def _scrub(doc: Any, secrets: list[str]) -> Any:
    """Replace every secret's text anywhere in the document (a server may echo one in an error)."""
    secrets = [s for s in secrets if s and len(s) >= 4]
    if isinstance(doc, dict):
        return {k: _scrub(v, secrets) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_scrub(v, secrets) for v in doc]
    if isinstance(doc, str):
        for s in secrets:
            doc = doc.replace(s, "[redacted]")
    return doc


def _env_secrets() -> list[str]:
    """Values of environment variables that look like credentials: never allowed into a report."""
    words = ("KEY", "TOKEN", "SECRET", "PASSWORD")
    return [v for k, v in os.environ.items() if any(w in k.upper() for w in words) and len(v) >= 8]


def write_and_summarize(report: dict, out: Path, secrets: list[str], json_out: bool) -> dict[str, Path]:
    from v100plan.report.write import write_reports

    report = _scrub(report, secrets + _env_secrets())
    paths = write_reports(report, out)
    if json_out:
        output.emit_json(report)
    s = report["summary"]
    output.hint(f"verdict: {report['verdict'].upper()}: {report['verdict_reason']}")
    output.hint(f"scenarios: {s['passed']} passed, {s['warned']} warned, {s['failed']} failed, "
                f"{s['waived']} waived, {s['error']} error")
    if report.get("load"):
        ld = report["load"]
        lat = ld["latency_s"]
        output.hint(f"load: {ld['requests']} requests from {ld['clients']} clients in {ld['wall_s']:.1f} s; "
                    f"outcomes {ld['outcomes']}; latency p50 {lat.get('p50')} s, p99 {lat.get('p99')} s; "
                    f"served decode {ld['served_decode_tok_s']} tok/s")
    for kind, p in paths.items():
        output.hint(f"{kind:>5}: {p}")
    return paths


def _exit_for(report: dict) -> None:
    if report["partial"]:
        raise typer.Exit(EXIT_INTERRUPTED if "Ctrl-C" in (report.get("partial_reason") or "") else EXIT_CHECK_FAILED)
    if report["verdict"] != "passed":
        raise typer.Exit(EXIT_CHECK_FAILED)


def _check_model_dir(path: Path | None, option: str) -> None:
    if path is not None and not (path / "config.json").exists():
        raise BadInput(f"{option} {str(path)!r} has no config.json",
                       hint="give a model directory in the Hugging Face layout (config.json, weights, tokenizer.json)")


def _load_doc(path: Path | None, kind: str) -> dict | None:
    return documents.load(path, kind) if path is not None else None


def register(app: typer.Typer) -> None:
    @app.command("accept")
    @remote_options()
    @suite_options
    def accept_cmd(
        endpoint: Annotated[Optional[str], typer.Option(
            "--endpoint", help="Base URL of any OpenAI-compatible service, e.g. http://127.0.0.1:8000.")] = None,
        host: Annotated[Optional[str], typer.Option(
            "--host", help="user@host[:port] where `v100plan deploy` put the engine: reached through an SSH "
                           "port forward, faults injected through its control, rank logs fetched.")] = None,
        remote: RemoteArgs = None,
        api_key_file: Annotated[Optional[Path], typer.Option(
            "--api-key-file", help="File holding the service's API key (mode 600); never printed or stored.")] = None,
        model: Annotated[Optional[str], typer.Option("--model", help="Model name to request (default: the first "
                                                                     "/v1/models lists).")] = None,
        model_dir: Annotated[Optional[Path], typer.Option(
            "--model-dir", help="The served weights on this machine: answers are then checked token for token "
                                "against the engine's own TP1 run.")] = None,
        supervised: Annotated[bool, typer.Option(
            "--supervised", help="The proxy runs under a supervisor: also kill it and drive a restart storm.")] = False,
        rank_logs: Annotated[Optional[Path], typer.Option(
            "--state-dir", help="The engine's state directory on this machine (its rank logs are read).")] = None,
        plan: PlanOpt = None,
        probe_report: ProbeOpt = None,
        suite: Suite = None,
    ) -> None:
        """Run the acceptance suite against a running OpenAI-compatible service and write the report.

        Functional and load scenarios run against any server; the fault scenarios need the bundled
        engine started with --enable-fault-injection (they are waived elsewhere, with the reason).
        Exit 0 when every scenario that ran passed, 1 otherwise, 4 when the service cannot be reached."""
        from v100plan.accept.context import Target

        if host and endpoint:
            raise BadInput("give --endpoint or --host, not both",
                           hint="--host reaches a deployed engine over SSH; --endpoint any URL from here")
        if host:
            _accept_host(host, remote, model, model_dir, plan, probe_report, suite)
            return
        if not endpoint:
            raise BadInput("accept needs --endpoint URL (the service to test) or --host HOST (a deployed engine)",
                           hint="e.g. v100plan accept --endpoint http://127.0.0.1:8000 --api-key-file key.txt")
        if not endpoint.startswith(("http://", "https://")):
            raise BadInput(f"--endpoint {endpoint!r} is not an http(s) URL", hint="e.g. --endpoint http://127.0.0.1:8000")
        key = read_api_key(api_key_file) if api_key_file else None
        opts, plan_doc, probe_doc, out_dir = _accept_inputs(suite, plan, probe_report, model_dir)
        target = Target(endpoint=endpoint, api_key=key, mode="endpoint", model=model,
                        model_dir=str(model_dir) if model_dir else None, supervised=supervised)
        if rank_logs is not None:
            from v100plan.accept.local import state_dir_readers

            target.read_rank_logs, target.read_service_log = state_dir_readers(rank_logs)
        report = _accept(target, opts, plan_doc, probe_doc, phases=[],
                         inputs={"endpoint": endpoint, "model": model, **suite.inputs(),
                                 "api_key": "given (not recorded)" if key else None},
                         show=not suite.json_out)
        write_and_summarize(report, out_dir, [key or ""], suite.json_out)
        _exit_for(report)

    @app.command("qualify")
    @remote_options(command_timeout=900.0, deployment="qualify", deployment_help=(
        "With --host: the deployment qualify makes, tests and stops on the host; its own, never your "
        "production one (a deployment `v100plan deploy` made is refused)."))
    @suite_options
    def qualify_cmd(
        model_dir: Annotated[Optional[Path], typer.Option(
            "--model", help="Model directory to serve (default: the generated demo model).")] = None,
        device: Annotated[str, typer.Option(
            "--device", help="auto (two GPUs if there are, else CPU), cpu, cuda, or two devices like cuda:0,cuda:1 "
                             "(with --host: auto, cpu or cuda).")] = "auto",
        host: Annotated[Optional[str], typer.Option(
            "--host", metavar="USER@HOST[:PORT]",
            help="Qualify that host over SSH instead of this machine: probe it, deploy the engine there with "
                 "fault injection under its own deployment (--deployment), accept it through an SSH port "
                 "forward, write the reports here, then stop that deployment.")] = None,
        port: Annotated[Optional[int], typer.Option(
            "--port", help=f"With --host: the port the qualify deployment binds on the host's 127.0.0.1 "
                           f"(default: {QUALIFY_PORT}).")] = None,
        index_url: IndexUrlOpt = None,
        torch_spec: TorchOpt = None,
        remote: RemoteArgs = None,
        suite: Suite = None,
    ) -> None:
        """The main job: probe this machine, plan, start the bundled two-rank service, run the acceptance
        suite against it (functional, every fault 3 times, load), and write report.json, report.html and
        junit.xml. With no GPU it serves the generated demo model on CPU and says so in the report.
        With --host the same runs against that host over SSH (the engine deployed there as its own
        deployment, stopped again at the end). Exit 0 only when every scenario that ran passed; Ctrl-C
        stops every process (and remote deployment) it started and still writes a partial report."""
        from v100plan.commands.qualify_run import LocalRun, qualify

        _need_accept_deps()
        opts = _options(suite)
        _check_model_dir(model_dir, "--model")
        parts = device.split(",")
        listed = len(parts) <= 2 and all(re.fullmatch(r"cuda:\d+", p.strip()) for p in parts)
        if device not in ("auto", "cpu", "cuda") and (host or not listed):
            raise BadInput(f"--device {device!r}: give auto, cpu, cuda" + ("" if host else
                           " or two devices such as cuda:0,cuda:1"),
                           hint="auto picks two GPUs when the probe finds them, else the CPU")
        if host:
            from v100plan.commands.qualify_host import HostRun

            if port is not None and not 1 <= port <= 65535:
                raise BadInput(f"--port {port} is out of range", hint="a port is 1-65535")
            run = HostRun(remote.target(host, index_url, torch_spec), port or QUALIFY_PORT, device)
        else:
            given = [n for n, v in (("--port", port), ("--index-url", index_url), ("--torch", torch_spec)) if v]
            if given:
                raise BadInput(f"{', '.join(given)} apply to --host only",
                               hint="qualify without --host starts the engine on this machine, on a free port")
            run = LocalRun(device)
        out_dir = _prepare_out(suite.out)
        report, secrets, problem = qualify(out_dir, model_dir, opts, run, show=not suite.json_out)
        write_and_summarize(report, out_dir, secrets, suite.json_out)
        if problem is not None:
            raise problem
        _exit_for(report)


def _accept_inputs(suite: Suite, plan: Path | None, probe_report: Path | None, model_dir: Path | None) -> tuple:
    """(AcceptOptions, plan document, probe document, the output directory), each checked."""
    _need_accept_deps()
    opts = _options(suite)
    plan_doc, probe_doc = _load_doc(plan, "plan"), _load_doc(probe_report, "probe_report")
    _check_model_dir(model_dir, "--model-dir")
    return opts, plan_doc, probe_doc, _prepare_out(suite.out)


def _accept_host(host: str, remote: RemoteArgs, model: str | None, model_dir: Path | None, plan: Path | None,
                 probe_report: Path | None, suite: Suite) -> None:
    """accept --host: the deployed engine through an SSH port forward (its control answers loopback only)."""
    from v100plan.remote.service import host_target, open_service

    opts, plan_doc, probe_doc, out_dir = _accept_inputs(suite, plan, probe_report, model_dir)
    target = remote.target(host)
    with open_service(target.spec, target.remote.root, target.deployment, ssh=target.ssh,
                      python=target.remote.python) as svc:
        report = _accept(host_target(svc, target.deployment, model, model_dir), opts, plan_doc, probe_doc,
                         phases=[], inputs={"host": host, "deployment": target.deployment, "model": model,
                                            **suite.inputs()},
                         show=not suite.json_out)
        secrets = [svc.api_key]
    write_and_summarize(report, out_dir, secrets, suite.json_out)
    _exit_for(report)


def _accept(target, opts, plan_doc, probe_doc, *, phases: list[dict], inputs: dict, show: bool) -> dict:
    from v100plan.accept.runner import assemble, run_acceptance

    t0 = time.monotonic()
    with _Progress(enabled=show) as progress:
        try:
            result = run_acceptance(target, opts, plan=plan_doc, probe=probe_doc, progress=progress)
        except ConnectionError as e:
            raise EnvironmentProblem(f"cannot accept {target.endpoint}: {e}",
                                     "check that the service runs and the URL and API key are right") from None
    wall = time.monotonic() - t0
    phases = phases + [{"name": "accept", "status": "interrupted" if result["partial_reason"] else "passed",
                        "wall_s": round(wall, 3), "detail": f"{len(result['scenarios'])} scenarios"}]
    return assemble(result, phases=phases, probe=probe_doc, plan=plan_doc, inputs=inputs, wall_s=wall)

