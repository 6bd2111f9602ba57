"""`v100plan accept` (any OpenAI-compatible endpoint) and `v100plan qualify` (the main job:
probe -> plan -> start the bundled service -> accept -> report)."""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from v100plan import documents, output
from v100plan.commands.remote_options import (
    AcceptNewOpt,
    CommandTimeoutOpt,
    ConnectTimeoutOpt,
    DeploymentOpt,
    IdentityOpt,
    KnownHostsOpt,
    RemotePythonOpt,
    RemoteRootOpt,
    ssh_options,
)
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


def _csv(text: str | None) -> tuple[str, ...]:
    return tuple(p.strip() for p in (text or "").split(",") if p.strip())


def _known_keys(values: tuple[str, ...], option: str) -> None:
    from v100plan.accept.cases import registry

    known = {c.key for c in registry()} | {"functional", "fault", "load"}
    unknown = [v for v in values if v not in known]
    if unknown:
        raise BadInput(f"{option}: unknown scenario {', '.join(map(repr, unknown))}",
                       hint=f"choose from {', '.join(sorted(known))}")


def read_api_key(path: Path) -> str:
    """The key from a file; a group- or world-readable file is refused (it would leak the key)."""
    try:
        st = path.stat()
        text = path.read_text().strip()
    except OSError as e:
        raise BadInput(f"--api-key-file {str(path)!r}: {e.strerror or e}", hint="give a readable file holding the key") \
            from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise BadInput(f"--api-key-file {str(path)!r} is readable by other users (mode {stat.S_IMODE(st.st_mode):o})",
                       hint=f"chmod 600 {path}")
    if not text:
        raise BadInput(f"--api-key-file {str(path)!r} is empty", hint="put the API key on the file's first line")
    return text


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


def _options(clients: int, requests: int, repeats: int, only: str | None, skip: str | None):
    from v100plan.accept.context import AcceptOptions

    o, s = _csv(only), _csv(skip)
    _known_keys(o, "--only")
    _known_keys(s, "--skip")
    if requests == 0:
        s = s + ("load",)
    return AcceptOptions(clients=clients, requests=requests, fault_repeats=repeats, only=o, skip=s)


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
    def accept_cmd(
        endpoint: Annotated[Optional[str], typer.Option(
            "--endpoint", help="Base URL of any OpenAI-compatible service, e.g. http://127.0.0.1:8000.")] = None,
        host: Annotated[Optional[str], typer.Option(
            "--host", help="user@host[:port] where `v100plan deploy` put the engine: reached through an SSH "
                           "port forward, faults injected through its control, rank logs fetched.")] = None,
        deployment: DeploymentOpt = "engine",
        remote_root: RemoteRootOpt = "~/.v100plan",
        remote_python: RemotePythonOpt = "python3",
        known_hosts: KnownHostsOpt = None,
        accept_new_host_key: AcceptNewOpt = False,
        identity: IdentityOpt = None,
        connect_timeout: ConnectTimeoutOpt = 10.0,
        command_timeout: CommandTimeoutOpt = 120.0,
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
        clients: ClientsOpt = 16,
        requests: RequestsOpt = 200,
        repeats: RepeatsOpt = 3,
        only: OnlyOpt = None,
        skip: SkipOpt = None,
        out: OutDirOpt = None,
        json_out: JsonOpt = False,
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
            _accept_host(host, deployment, remote_root, remote_python,
                         ssh_options(known_hosts, accept_new_host_key, identity, connect_timeout, command_timeout),
                         model, model_dir, plan, probe_report, (clients, requests, repeats, only, skip), out, json_out)
            return
        if not endpoint:
            raise BadInput("accept needs --endpoint URL (the service to test) or --host HOST (a deployed engine)",
                           hint="e.g. v100plan accept --endpoint http://127.0.0.1:8000 --api-key-file key.txt")
        if not endpoint.startswith(("http://", "https://")):
            raise BadInput(f"--endpoint {endpoint!r} is not an http(s) URL", hint="e.g. --endpoint http://127.0.0.1:8000")
        _need_accept_deps()
        key = read_api_key(api_key_file) if api_key_file else None
        opts = _options(clients, requests, repeats, only, skip)
        plan_doc, probe_doc = _load_doc(plan, "plan"), _load_doc(probe_report, "probe_report")
        _check_model_dir(model_dir, "--model-dir")
        out_dir = _prepare_out(out)
        target = Target(endpoint=endpoint, api_key=key, mode="endpoint", model=model,
                        model_dir=str(model_dir) if model_dir else None, supervised=supervised)
        if rank_logs is not None:
            from v100plan.accept.local import state_dir_readers

            target.read_rank_logs, target.read_service_log = state_dir_readers(rank_logs)
        report = _accept(target, opts, plan_doc, probe_doc, phases=[],
                         inputs={"endpoint": endpoint, "model": model, "clients": clients, "requests": requests,
                                 "repeats": repeats, "only": only, "skip": skip,
                                 "api_key": "given (not recorded)" if key else None},
                         show=not json_out)
        write_and_summarize(report, out_dir, [key or ""], json_out)
        _exit_for(report)

    @app.command("qualify")
    def qualify_cmd(
        model_dir: Annotated[Optional[Path], typer.Option(
            "--model", help="Model directory to serve (default: the generated demo model).")] = None,
        device: Annotated[str, typer.Option(
            "--device", help="auto (two GPUs if there are, else CPU), cpu, cuda, or two devices like cuda:0,cuda:1.")]
        = "auto",
        clients: ClientsOpt = 16,
        requests: RequestsOpt = 200,
        repeats: RepeatsOpt = 3,
        only: OnlyOpt = None,
        skip: SkipOpt = None,
        out: OutDirOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """The main job: probe this machine, plan, start the bundled two-rank service, run the acceptance
        suite against it (functional, every fault 3 times, load), and write report.json, report.html and
        junit.xml. With no GPU it serves the generated demo model on CPU and says so in the report.
        Exit 0 only when every scenario that ran passed; Ctrl-C stops every process it started and
        still writes a partial report."""
        from v100plan.commands.qualify_run import qualify

        _need_accept_deps()
        opts = _options(clients, requests, repeats, only, skip)
        _check_model_dir(model_dir, "--model")
        parts = device.split(",")
        listed = len(parts) <= 2 and all(re.fullmatch(r"cuda:\d+", p.strip()) for p in parts)
        if device not in ("auto", "cpu", "cuda") and not listed:
            raise BadInput(f"--device {device!r}: give auto, cpu, cuda or two devices such as cuda:0,cuda:1",
                           hint="auto picks two GPUs when the probe finds them, else the CPU")
        out_dir = _prepare_out(out)
        report, secrets, problem = qualify(out_dir, model_dir, device, opts, show=not json_out)
        write_and_summarize(report, out_dir, secrets, json_out)
        if problem is not None:
            raise problem
        _exit_for(report)


def _accept_host(host: str, deployment: str, remote_root: str, remote_python: str, ssh, model: str | None,
                 model_dir: Path | None, plan: Path | None, probe_report: Path | None, load: tuple,
                 out: Path | None, json_out: bool) -> None:
    """accept --host: the deployed engine through an SSH port forward (its control answers loopback only)."""
    from v100plan.accept.context import Target
    from v100plan.remote.service import open_service

    _need_accept_deps()
    clients, requests, repeats, only, skip = load
    opts = _options(clients, requests, repeats, only, skip)
    plan_doc, probe_doc = _load_doc(plan, "plan"), _load_doc(probe_report, "probe_report")
    _check_model_dir(model_dir, "--model-dir")
    out_dir = _prepare_out(out)
    with open_service(host, remote_root, deployment, ssh=ssh, python=remote_python) as svc:
        target = Target(endpoint=svc.endpoint, api_key=svc.api_key, mode="host", host=svc.host or host, model=model,
                        model_dir=str(model_dir) if model_dir else None, engine=svc.engine,
                        supervised=svc.supervised, read_rank_logs=svc.read_rank_logs,
                        read_service_log=svc.read_service_log,
                        notes=[f"deployment {deployment!r}, release {svc.release}, reached through an SSH port "
                               f"forward to the host's 127.0.0.1:{svc.remote_port}"])
        report = _accept(target, opts, plan_doc, probe_doc, phases=[],
                         inputs={"host": host, "deployment": deployment, "model": model, "clients": clients,
                                 "requests": requests, "repeats": repeats, "only": only, "skip": skip},
                         show=not json_out)
        secrets = [svc.api_key]
    write_and_summarize(report, out_dir, secrets, json_out)
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

