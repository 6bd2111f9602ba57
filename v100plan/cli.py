"""The typer app: declare options, validate combinations, make one library call, render.

Every error a user can cause surfaces as ``Error: ...`` plus a hint on stderr and
an exit code from v100plan.errors, never a traceback. V100PLAN_DEBUG=1 re-raises
so the traceback shows.
"""

from __future__ import annotations

import os
import sys

import typer
from typer.core import TyperGroup

from v100plan import __version__
from v100plan.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, V100planError


def _debug() -> bool:
    return os.environ.get("V100PLAN_DEBUG", "") not in ("", "0")


def _command(ctx) -> str:  # noqa: ANN001 - click's Context
    """`v100plan deploy`: the command being run, for messages."""
    sub = ctx.invoked_subcommand
    return f"`{ctx.command_path}{' ' + sub if sub else ''}`"


class _Group(TyperGroup):
    """Turns domain errors into a message and an exit code at the outermost command."""

    def format_commands(self, ctx, formatter):  # noqa: ANN001 - click's signature
        """Each command's summary sentence in full (click would cut it at the terminal's width with '...')."""
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=1000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def invoke(self, ctx):  # noqa: ANN001 - click's signature
        from v100plan import output

        try:
            return super().invoke(ctx)
        except V100planError as e:
            if _debug():
                raise
            output.error(e.message, e.hint)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            if _debug():
                raise
            output.error("interrupted", "the command stopped before it finished; run it again to redo it")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except (typer.Exit, typer.Abort):
            raise
        except Exception as e:  # noqa: BLE001 - the last line of defence
            from v100plan.extras import from_import_error

            # an optional extra not installed (deploy's paramiko, accept's httpx): say which, exit 4
            missing = from_import_error(e, _command(ctx)) if isinstance(e, ModuleNotFoundError) else None
            if missing is not None and not _debug():
                output.error(missing.message, missing.hint)
                raise typer.Exit(missing.exit_code) from None
            # Usage errors (typer.BadParameter and friends) are the CLI library's to print.
            if _debug() or any(c.__name__ == "ClickException" for c in type(e).__mro__):
                raise
            output.error(
                f"internal error: {type(e).__name__}: {e}",
                "this is a bug in v100plan; run again with V100PLAN_DEBUG=1 for the traceback and report it",
            )
            raise typer.Exit(EXIT_INTERNAL) from None


app = typer.Typer(
    cls=_Group,
    name="v100plan",
    help="Hardware-aware planning and qualification of LLM serving on second-hand data-centre GPUs (V100 first). "
         "Each command below says what it does; `v100plan COMMAND --help` gives its options and defaults.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,  # SSH secrets pass through locals
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,
)

bench_app = typer.Typer(cls=_Group, help="Benchmarks: commands that print measured figures.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _version(value: bool) -> None:
    if value:
        print(f"v100plan {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """v100plan: hardware-aware deployment planner and qualification CLI."""


def _register() -> None:
    # Each command module owns its commands; this list is the only wiring.
    from v100plan.commands import bench_engine, bench_probes, bench_tp2, planning, probe

    planning.register(app)
    probe.register(app)
    from v100plan.commands import accept, qualify

    accept.register(app)
    qualify.register(app)
    from v100plan.commands import deploy, deploy_manage

    deploy.register(app)
    deploy_manage.register(app)
    bench_probes.register(bench_app)
    bench_engine.register(bench_app)
    bench_tp2.register(bench_app)
    from v100plan.commands import bench_planner, calibrate

    bench_planner.register(bench_app)
    calibrate.register(app)


_register()


def main() -> None:
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
