"""`v100plan accept`: the acceptance suite against any OpenAI-compatible endpoint, or a deployed engine
reached over SSH (--host). Exit 0 when every scenario that ran passed, 1 otherwise, 4 when the service
cannot be reached."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from v100plan.commands.remote_options import RemoteArgs, remote_options
from v100plan.commands.suite import (
    PlanOpt,
    ProbeOpt,
    Suite,
    accept_options,
    check_model_dir,
    exit_for,
    load_doc,
    need_accept_deps,
    prepare_out,
    read_api_key,
    suite_options,
)
from v100plan.errors import BadInput
from v100plan.qualify.reports import accept_report, write_and_summarize


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
        report = accept_report(target, opts, plan_doc, probe_doc,
                               inputs={"endpoint": endpoint, "model": model, **suite.inputs(),
                                 "api_key": "given (not recorded)" if key else None},
                         show=not suite.json_out)
        write_and_summarize(report, out_dir, [key or ""], suite.json_out)
        exit_for(report)


def _accept_inputs(suite: Suite, plan: Path | None, probe_report: Path | None, model_dir: Path | None) -> tuple:
    """(AcceptOptions, plan document, probe document, the output directory), each checked."""
    need_accept_deps()
    opts = accept_options(suite)
    plan_doc, probe_doc = load_doc(plan, "plan"), load_doc(probe_report, "probe_report")
    check_model_dir(model_dir, "--model-dir")
    return opts, plan_doc, probe_doc, prepare_out(suite.out)


def _accept_host(host: str, remote: RemoteArgs, model: str | None, model_dir: Path | None, plan: Path | None,
                 probe_report: Path | None, suite: Suite) -> None:
    """accept --host: the deployed engine through an SSH port forward (its control answers loopback only)."""
    from v100plan.remote.service import host_target, open_service

    opts, plan_doc, probe_doc, out_dir = _accept_inputs(suite, plan, probe_report, model_dir)
    target = remote.target(host)
    with open_service(target.spec, target.remote.root, target.deployment, ssh=target.ssh,
                      python=target.remote.python) as svc:
        report = accept_report(host_target(svc, target.deployment, model, model_dir), opts, plan_doc, probe_doc,
                               inputs={"host": host, "deployment": target.deployment, "model": model,
                                            **suite.inputs()},
                         show=not suite.json_out)
        secrets = [svc.api_key]
    write_and_summarize(report, out_dir, secrets, suite.json_out)
    exit_for(report)
