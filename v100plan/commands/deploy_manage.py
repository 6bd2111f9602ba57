"""`v100plan logs | remove | key show | key rotate HOST`: a deployment's logs, its removal from the host, its
API key."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from v100plan import output
from v100plan.commands.remote_options import (
    DrainTimeoutOpt,
    HostArg,
    RemoteArgs,
    emit,
    remote_options,
    say,
    switch_target,
)
from v100plan.errors import BadInput
from v100plan.options import JsonOpt, QuietOpt


def register(app: typer.Typer) -> None:
    key_app = typer.Typer(help="The API key of a deployment on HOST: show it, or rotate it.", no_args_is_help=True)
    app.add_typer(key_app, name="key")

    @key_app.command("show")
    @remote_options()
    def key_show_cmd(host: HostArg, remote: RemoteArgs = None, json_out: JsonOpt = False) -> None:
        """Print the deployment's API key (stdout only; it is never logged)."""
        from v100plan.remote import deploy as dp

        doc = dp.key_show(remote.target(host))
        if json_out:
            output.emit_json(doc)
        else:
            print(doc["key"])

    @key_app.command("rotate")
    @remote_options(command_timeout=900.0)
    def key_rotate_cmd(
        host: HostArg,
        health_timeout: Annotated[float, typer.Option("--health-timeout", metavar="S",
                                                      help="Seconds the service has to pass /health.")] = 180.0,
        drain_timeout: DrainTimeoutOpt = 300.0,
        remote: RemoteArgs = None,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        """A new API key for the deployment on HOST; the old one stops working. The service reads its key when it
        starts: the current release starts afresh beside itself and takes over (no failed request, nothing
        uploaded); `v100plan key show HOST` prints the new key."""
        from v100plan.remote import deploy as dp

        target = switch_target(remote.target(host), drain_timeout, 5)
        out = dp.key_rotate(target, health_timeout, say(quiet))
        emit(out.to_dict(), [("host", out.host), ("release", out.release), ("key", "rotated"),
                              ("restarted", out.restarted), ("wall s", f"{out.wall_s:.1f}")], "Key rotation",
             json_out, quiet)

    @app.command("logs")
    @remote_options()
    def logs_cmd(
        host: HostArg,
        follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines (Ctrl-C ends).")] = False,
        lines: Annotated[int, typer.Option("--lines", "-n", help="Lines from the end of each log.")] = 50,
        release: Annotated[Optional[str], typer.Option(
            "--release", metavar="ID", help="The logs of where release ID last ran (a failed start too) instead "
                                            "of the serving release's.")] = None,
        remote: RemoteArgs = None,
        json_out: JsonOpt = False,
    ) -> None:
        """The serving release's logs on HOST: the proxy's stderr and structured log, the supervisor's, each rank's latest, the front's."""
        from v100plan.remote import deploy as dp

        if lines < 0:
            raise BadInput("--lines must be 0 or more", hint="e.g. --lines 100")
        target = remote.target(host)
        if follow:
            if json_out or release:
                raise BadInput("--follow streams the serving release's lines; it cannot be one JSON document or "
                               "another release's", hint="drop --json and --release")
            try:
                dp.follow_logs(target, lambda line: print(line, flush=True), lines)
            except KeyboardInterrupt:
                pass
            return
        doc = dp.logs(target, lines, release=release)
        if json_out:
            output.emit_json(doc)
            return
        for name, text in doc["logs"].items():
            print(f"==> {name} <==")
            print("(no such log yet)" if text is None else "\n".join(text))


    @app.command("remove")
    @remote_options()
    def remove_cmd(
        host: HostArg,
        yes: Annotated[bool, typer.Option("--yes", help="Really delete the deployment (its releases, logs, "
                                                        "API key and history) on HOST.")] = False,
        venvs: Annotated[bool, typer.Option("--venvs", help="Also delete the host's venvs that no other "
                                                             "deployment's release uses (about 1 GB each with "
                                                             "torch; a later deploy or probe builds them again).")] = False,
        remote: RemoteArgs = None,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        """Stop the service on HOST and delete its deployment there; the host's model store drops a model
        only once no release of any deployment links it."""
        from v100plan.remote import deploy as dp

        target = remote.target(host)
        if not yes:
            raise BadInput(f"remove deletes deployment {target.deployment!r} on {target.spec.label}: its releases, "
                           "logs, API key and history", hint="add --yes to do it; `v100plan stop` only stops it")
        out = dp.remove(target, say(quiet), venvs=venvs)
        emit(out.to_dict(), [("host", out.host), ("removed", out.extra.get("removed")),
                              ("stopped", out.extra.get("stopped") or out.reason),
                              ("models removed", ", ".join(out.extra.get("models_removed") or []) or "none"),
                              ("venvs removed", ", ".join(out.extra.get("venvs_removed") or []) or "none")],
              "Remove", json_out, quiet)
