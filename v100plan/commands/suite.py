"""The acceptance suite's options, shared by `accept` and `qualify`: declared once, checked once.

Public names only: both command modules import them (as both import remote_options)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from v100plan import documents
from v100plan.api_key import read_api_key  # noqa: F401  (the suite options read it)
from v100plan.commands.remote_options import option_group
from v100plan.errors import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, BadInput, EnvironmentProblem
from v100plan.options import JsonOpt

OutDirOpt = Annotated[Optional[Path], typer.Option(
    "--out", "-o", help="Directory for report.json, report.html, junit.xml and the service logs "
                        "(default: ./v100plan-report).")]
ClientsOpt = Annotated[int, typer.Option("--clients", min=1, max=256, help="Concurrent clients in the load scenario (raised to the service's max_concurrency where its /health "
                                   "says more).")]
RequestsOpt = Annotated[int, typer.Option("--requests", min=0, max=100000,
                                          help="Requests in all in the load scenario (0 waives it).")]
RepeatsOpt = Annotated[int, typer.Option("--repeats", min=1, max=50, help="Repetitions of each injected fault.")]
OnlyOpt = Annotated[Optional[str], typer.Option(
    "--only", help="Comma-separated scenario keys or groups (functional, fault, load) to run; the rest are waived.")]
SkipOpt = Annotated[Optional[str], typer.Option("--skip", help="Comma-separated scenario keys or groups to waive.")]
PlanOpt = Annotated[Optional[Path], typer.Option("--plan", help="A Plan JSON: the report holds its predictions "
                                                                "(decode at its context, TTFT, memory per GPU, max "
                                                                "context) against what the run measures.")]
ProbeOpt = Annotated[Optional[Path], typer.Option("--probe-report", help="A ProbeReport JSON to embed in the report.")]

DEFAULT_OUT = Path("v100plan-report")


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


def prepare_out(out: Path | None) -> Path:
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


def accept_options(suite: Suite):
    from v100plan.accept.context import AcceptOptions

    o, s = _csv(suite.only), _csv(suite.skip)
    _known_keys(o, "--only")
    _known_keys(s, "--skip")
    if suite.requests == 0:
        s = s + ("load",)
    return AcceptOptions(clients=suite.clients, requests=suite.requests, fault_repeats=suite.repeats, only=o, skip=s)


def need_accept_deps() -> None:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise EnvironmentProblem("the acceptance suite needs httpx, which is not installed",
                                 "pip install 'v100plan[accept]'") from None


def exit_for(report: dict) -> None:
    if report["partial"]:
        raise typer.Exit(EXIT_INTERRUPTED if "Ctrl-C" in (report.get("partial_reason") or "") else EXIT_CHECK_FAILED)
    if report["verdict"] != "passed":
        raise typer.Exit(EXIT_CHECK_FAILED)


def check_model_dir(path: Path | None, option: str) -> None:
    if path is not None and not (path / "config.json").exists():
        raise BadInput(f"{option} {str(path)!r} has no config.json",
                       hint="give a model directory in the Hugging Face layout (config.json, weights, tokenizer.json)")


def load_doc(path: Path | None, kind: str) -> dict | None:
    return documents.load(path, kind) if path is not None else None


