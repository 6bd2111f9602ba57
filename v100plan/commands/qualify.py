"""`v100plan qualify`, the main job: probe -> plan -> start the bundled service -> accept -> report,
on this machine or (--host) on a host over SSH. The phases are v100plan.qualify's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from v100plan.commands.remote_options import IndexUrlOpt, RemoteArgs, TorchOpt, remote_options
from v100plan.commands.suite import (
    Suite,
    accept_options,
    check_model_dir,
    exit_for,
    need_accept_deps,
    prepare_out,
    suite_options,
)
from v100plan.errors import BadInput
from v100plan.qualify.reports import write_and_summarize

QUALIFY_PORT = 8100  # qualify --host's own service port on the host (a production deploy defaults to 8000)


def register(app: typer.Typer) -> None:
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
        from v100plan.qualify.local import LocalRun
        from v100plan.qualify.phases import qualify

        need_accept_deps()
        opts = accept_options(suite)
        check_model_dir(model_dir, "--model")
        parts = device.split(",")
        listed = len(parts) <= 2 and all(re.fullmatch(r"cuda:\d+", p.strip()) for p in parts)
        if device not in ("auto", "cpu", "cuda") and (host or not listed):
            raise BadInput(f"--device {device!r}: give auto, cpu, cuda" + ("" if host else
                           " or two devices such as cuda:0,cuda:1"),
                           hint="auto picks two GPUs when the probe finds them, else the CPU")
        if host:
            from v100plan.qualify.host import HostRun

            if port is not None and not 1 <= port <= 65535:
                raise BadInput(f"--port {port} is out of range", hint="a port is 1-65535")
            run = HostRun(remote.target(host, index_url, torch_spec), port or QUALIFY_PORT, device)
        else:
            given = [n for n, v in (("--port", port), ("--index-url", index_url), ("--torch", torch_spec)) if v]
            if given:
                raise BadInput(f"{', '.join(given)} apply to --host only",
                               hint="qualify without --host starts the engine on this machine, on a free port")
            run = LocalRun(device)
        out_dir = prepare_out(suite.out)
        report, secrets, problem = qualify(out_dir, model_dir, opts, run, show=not suite.json_out)
        write_and_summarize(report, out_dir, secrets, suite.json_out)
        if problem is not None:
            raise problem
        exit_for(report)
