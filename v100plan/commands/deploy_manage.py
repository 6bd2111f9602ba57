"""`v100plan logs | remove HOST`: a deployment's logs, and its removal from the host."""

from __future__ import annotations

from typing import Annotated

import typer

from v100plan import output
from v100plan.commands.remote_options import HostArg, RemoteArgs, emit, remote_options, say
from v100plan.errors import BadInput
from v100plan.options import JsonOpt, QuietOpt


def register(app: typer.Typer) -> None:
    @app.command("logs")
    @remote_options()
    def logs_cmd(
        host: HostArg,
        follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines (Ctrl-C ends).")] = False,
        lines: Annotated[int, typer.Option("--lines", "-n", help="Lines from the end of each log.")] = 50,
        remote: RemoteArgs = None,
        json_out: JsonOpt = False,
    ) -> None:
        """The serving release's logs on HOST: the proxy's stderr and structured log, the supervisor's, each rank's latest, the front's."""
        from v100plan.remote import deploy as dp

        if lines < 0:
            raise BadInput("--lines must be 0 or more", hint="e.g. --lines 100")
        target = remote.target(host)
        if follow:
            if json_out:
                raise BadInput("--follow streams lines; it cannot be one JSON document", hint="drop --json")
            try:
                dp.follow_logs(target, lambda line: print(line, flush=True), lines)
            except KeyboardInterrupt:
                pass
            return
        doc = dp.logs(target, lines)
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
        out = dp.remove(target, say(quiet))
        emit(out.to_dict(), [("host", out.host), ("removed", out.extra.get("removed")),
                              ("stopped", out.extra.get("stopped") or out.reason),
                              ("models removed", ", ".join(out.extra.get("models_removed") or []) or "none")],
              "Remove", json_out, quiet)
