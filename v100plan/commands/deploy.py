"""`v100plan deploy | rollback | status | stop HOST`: the bundled engine on a host, over SSH.

Progress lines go to stderr; the result (a table, or one JSON document with --json) to stdout.
Exit codes: 0 done (or nothing to do), 1 the new release failed its checks (rolled back when a
previous release existed), 2 bad input, 4 the host is unreachable, its key is unknown or changed,
a remote command hung, or another deploy holds the lock.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from v100plan import documents
from v100plan.commands.remote_options import (
    AllreduceOpt,
    DraftTokensOpt,
    DrainTimeoutOpt,
    DtypeOpt,
    FleetHostArg,
    IndexUrlOpt,
    InventoryOpt,
    KeepReleasesOpt,
    KvCacheDtypeOpt,
    MaxConcurrencyOpt,
    RemoteArgs,
    SpeculativeOpt,
    TorchOpt,
    emit,
    emit_fleet,
    remote_options,
    say,
    switch_target,
    targets_of,
)
from v100plan.demo_model import demo_model_dir
from v100plan.errors import BadInput
from v100plan.options import JsonOpt, QuietOpt
from v100plan.remote.connect import interrupt_on_sigterm

SwitchOpt = Annotated[str, typer.Option(
    "--switch", metavar="MODE",
    help="auto (default): blue-green where every card (nvidia-smi's free memory now) holds the new release's "
         "rank beside what runs there, and on CPU hosts; else stop-start, with the outage named. blue-green: "
         "the new release starts beside the serving one and takes over with no outage (refused, exit 2, where "
         "it does not fit); stop-start: stop, then start.")]
SWITCH_MODES = ("auto", "blue-green", "stop-start")


def _switch_mode(text: str) -> str:
    if text not in SWITCH_MODES:
        raise BadInput(f"--switch {text!r}: use one of {', '.join(SWITCH_MODES)}", hint="e.g. --switch blue-green")
    return text


def register(app: typer.Typer) -> None:
    @app.command("deploy")
    @remote_options(command_timeout=900.0)
    def deploy_cmd(
        host: FleetHostArg = None,
        inventory: InventoryOpt = None,
        plan: Annotated[Optional[Path], typer.Option("--plan", help="Plan JSON whose launch settings to use "
                                                     "(without it: probe the host and choose).")] = None,
        model: Annotated[Optional[Path], typer.Option("--model", help="Model directory (Hugging Face layout).")] = None,
        demo_model: Annotated[bool, typer.Option("--demo-model", help="Deploy the small generated demo model.")] = False,
        port: Annotated[int, typer.Option("--port", help="Port the service binds on the host's 127.0.0.1.")] = 8000,
        max_context: Annotated[Optional[int], typer.Option("--max-context", help="Tokens per request "
                                                           "(default: the plan's, else the model's).")] = None,
        dtype: DtypeOpt = None,
        kv_cache_dtype: KvCacheDtypeOpt = None,
        speculative: SpeculativeOpt = None,
        draft_tokens: DraftTokensOpt = None,
        allreduce: AllreduceOpt = None,
        max_concurrency: MaxConcurrencyOpt = None,
        fault_injection: Annotated[bool, typer.Option("--enable-fault-injection",
                                                      help="Expose /control (loopback) for `accept`.")] = False,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Only read the host and print every action.")] = False,
        health_timeout: Annotated[float, typer.Option("--health-timeout", metavar="S",
                                                      help="Seconds the new release has to pass /health.")] = 180.0,
        index_url: IndexUrlOpt = None,
        torch_spec: TorchOpt = None,
        switch: SwitchOpt = "auto",
        drain_timeout: DrainTimeoutOpt = 300.0,
        keep_releases: KeepReleasesOpt = 5,
        remote: RemoteArgs = None,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        """Push the engine and a model (split here into its two tensor-parallel shards) to HOST (or every host
        of --inventory, in parallel), start it under its supervisor, health-check, switch.

        `current` moves to the new release only after /health and a smoke completion pass;
        otherwise the previous release is started again (exit 1, with the reason).
        """
        from v100plan.remote import deploy as dp
        from v100plan.remote import own_plan
        from v100plan.remote import release as rel
        from v100plan.remote import split as split_mod
        from v100plan.remote.probe import NotPrepared, probe_host

        if (model is None) == (not demo_model):
            raise BadInput("give exactly one of --model DIR and --demo-model",
                           hint="e.g. v100plan deploy user@gpu-box --demo-model")
        if not 1 <= port <= 65535:
            raise BadInput(f"--port {port} is out of range", hint="a port is 1-65535")
        if health_timeout <= 0:
            raise BadInput("--health-timeout must be positive", hint="e.g. --health-timeout 300")
        switch_mode = _switch_mode(switch)
        overrides = rel.overrides_from_flags(max_context, dtype, kv_cache_dtype, speculative, draft_tokens, allreduce,
                                             max_concurrency)
        targets = [switch_target(t, drain_timeout, keep_releases)
                   for t in targets_of(remote, host, inventory, index_url, torch_spec)]
        interrupt_on_sigterm()  # a TERM cleans up as Ctrl-C does: the old release serving, or the new one switched
        tell = say(quiet)
        model_dir = demo_model_dir() if demo_model else model
        if not Path(model_dir).is_dir():
            raise BadInput(f"--model {str(model_dir)!r} is not a directory", hint="give the model's directory")
        rel.check_json_files(Path(model_dir))  # a broken tokenizer.json fails here, not after the upload
        doc = documents.load(plan, "plan") if plan is not None else None
        origin = rel.plan_origin(doc, str(plan), rel.file_sha256(plan)) if doc is not None else None
        if inventory is not None and not dry_run:  # split once here, before the hosts' threads reuse it
            split_mod.split(model_dir, rel.model_files(model_dir))

        def one(target, tell) -> dp.Outcome:  # noqa: ANN001 - a Target, a Say
            probe_sent: list[int] = []  # the bundle, when the probe that chooses the settings sent it
            own = None
            if doc is not None:
                settings, chose = rel.settings_from_plan(doc, str(plan), port, fault_injection)
            else:
                tell(f"probing {target.spec.label} to choose the engine settings (no --plan given)")
                try:
                    report = probe_host(target.spec, target.ssh, target.remote, ["--quick"], read_only=dry_run,
                                        sent=probe_sent)
                except NotPrepared:  # a dry run must not upload the probes or build their venv
                    report = None
                if report is None:
                    settings = rel.EngineSettings(port=port, fault_injection=fault_injection,
                                                  max_context=max_context, allreduce="gloo",
                                                  chosen_by="defaults (dry run)")
                    chose = ("CPU settings for this dry run: probing the host would upload the probes and build "
                             "their venv there; a real deploy probes first and may choose GPUs")
                else:  # the probe planned here: the plan's tp2 settings, or the probe's where it cannot run
                    settings, chose, own = own_plan.settings_for_host(report, model_dir, target.spec.label, port,
                                                                      fault_injection, max_context)
            settings, given = rel.with_overrides(settings, overrides)
            chose += given
            rel.check_speculation(settings, Path(model_dir))  # and N > 1 beside it
            tell(f"chose: {chose}")
            return dp.deploy(target, model_dir, settings, dry_run=dry_run, health_timeout_s=health_timeout,
                             say=tell, chose=chose, switch_mode=switch_mode, probe_sent=sum(probe_sent),
                             origin={"chosen_by": settings.chosen_by, **(origin or own or {}),
                                     "given": {k: v for k, v in overrides.items() if v is not None}})

        if inventory is not None:
            from v100plan.remote import fleet

            results = fleet.run(targets, lambda t, s: one(t, s).to_dict(), tell)
            emit_fleet("deploy", inventory, results, ("release", "previous", "changed", "reason"), json_out, quiet)
            return
        out = one(targets[0], tell)
        emit(out.to_dict(), dp.deploy_rows(out), "Dry run (nothing changed on the host)" if dry_run else "Deploy",
             json_out, quiet)

    @app.command("rollback")
    @remote_options(command_timeout=900.0)
    def rollback_cmd(
        host: FleetHostArg = None,
        inventory: InventoryOpt = None,
        health_timeout: Annotated[float, typer.Option(
            "--health-timeout", metavar="S",
            help="Seconds the previous release may take to pass /health and a smoke request.")] = 180.0,
        to: Annotated[Optional[str], typer.Option(
            "--to", metavar="RELEASE", help="The release to go back to (an id, or its unique start; "
                                           "`v100plan status` lists them). Default: the one before.")] = None,
        switch: SwitchOpt = "auto",
        drain_timeout: DrainTimeoutOpt = 300.0,
        keep_releases: KeepReleasesOpt = 5,
        remote: RemoteArgs = None,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        """Switch HOST (or every host of --inventory) back to the release that was current before this one
        (health-checked); again and it goes one further back."""
        from v100plan.remote import deploy as dp

        interrupt_on_sigterm()
        mode = _switch_mode(switch)
        targets = [switch_target(t, drain_timeout, keep_releases) for t in targets_of(remote, host, inventory)]

        def one(target, tell):  # noqa: ANN001, ANN202
            return dp.rollback(target, health_timeout, tell, to=to, switch_mode=mode)

        if inventory is not None:
            from v100plan.remote import fleet

            results = fleet.run(targets, lambda t, s: one(t, s).to_dict(), say(quiet))
            emit_fleet("rollback", inventory, results, ("release", "previous"), json_out, quiet)
            return
        out = one(targets[0], say(quiet))
        emit(out.to_dict(), [("host", out.host), ("release", out.release), ("was", out.previous),
                              ("switch", f"{out.extra['switch']['mode']}: {out.extra['switch']['why']}"),
                              ("wall s", f"{out.wall_s:.1f}")], "Rollback", json_out, quiet)

    def status(target, quiet: bool) -> tuple[dict, list]:  # noqa: ANN001
        from v100plan.remote import deploy as dp
        from v100plan.remote.manage import status_rows

        doc = dp.status(target)
        return doc, status_rows(doc)

    def stop(target, quiet: bool) -> tuple[dict, list]:  # noqa: ANN001
        from v100plan.remote import deploy as dp

        out = dp.stop(target, say(quiet))
        return out.to_dict(), [("host", out.host), ("release", out.release),
                               ("stopped", out.extra.get("stopped") or out.reason)]

    _one_call(app, "status", "Release, health, ranks, allreduce path and uptime of the service on HOST (or every "
              "host of --inventory); exit 1 when it is degraded (one of its processes, the front included, is not "
              "running).", status, ("state", "release", "down"))
    _one_call(app, "stop", "Stop the service on HOST or every host of --inventory (the supervisor's recorded PIDs; "
              "the release stays current).", stop, ("release", "stopped"))


def _one_call(app: typer.Typer, name: str, help_text: str, call, fields: tuple[str, ...]) -> None:  # noqa: ANN001
    """A command that makes one call on the deployment of HOST (or of every host of --inventory, in parallel)
    and shows its result as a table (or --json)."""

    @app.command(name, help=help_text)
    @remote_options()
    def command(
        host: FleetHostArg = None,
        inventory: InventoryOpt = None,
        remote: RemoteArgs = None,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        targets = targets_of(remote, host, inventory)
        if inventory is not None:
            from v100plan.remote import fleet

            results = fleet.run(targets, lambda t, s: call(t, True)[0], say(quiet))
            emit_fleet(name, inventory, results, fields, json_out, quiet)
            return
        doc, rows = call(targets[0], quiet)
        emit(doc, rows, name.capitalize(), json_out, quiet)
        if doc.get("state") == "degraded":
            raise typer.Exit(1)
