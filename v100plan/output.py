"""The one module that imports rich. Results go to stdout, everything else to stderr.

Modes: human (tables on stderr when --json is given, else stdout), ``--json``
(exactly one JSON document on stdout, nothing else there) and quiet.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

# Wide enough that golden renderings do not depend on the terminal.
GOLDEN_WIDTH = 120


def _width(stream) -> int | None:
    """V100PLAN_WIDTH if set; the terminal's width on a terminal; else GOLDEN_WIDTH.

    Piped output (a file, `less`, a CI log) has no width of its own; rich would
    assume 80 columns and truncate the tables' headers.
    """
    w = os.environ.get("V100PLAN_WIDTH")
    if w and w.isdigit():
        return int(w)
    try:
        if stream.isatty():
            return None
    except (AttributeError, ValueError):
        pass
    return GOLDEN_WIDTH


def stdout_console() -> Console:
    return Console(file=sys.stdout, width=_width(sys.stdout), soft_wrap=False, highlight=False)


def stderr_console() -> Console:
    return Console(file=sys.stderr, width=_width(sys.stderr), highlight=False)


def emit_json(doc: Any) -> None:
    """Write exactly one JSON document to stdout."""
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def hint(text: str) -> None:
    """A hint or note for a person: always stderr, so stdout stays machine-readable."""
    stderr_console().print(text)


def error(message: str, hint_text: str | None = None) -> None:
    con = stderr_console()
    con.print(f"[bold red]Error:[/] {message}", markup=True, highlight=False)
    if hint_text:
        con.print(f"[dim]Hint:[/] {hint_text}", markup=True, highlight=False)


def table(
    title: str | None,
    columns: Sequence[str | tuple[str, str]],
    rows: Iterable[Sequence[Any]],
    caption: str | None = None,
) -> Table:
    """A rich Table. ``columns`` items are a header or (header, justify)."""
    t = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for col in columns:
        header, justify = (col, "left") if isinstance(col, str) else col
        t.add_column(header, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        t.add_row(*("—" if v is None else str(v) for v in row))
    return t


def render(renderable: Any, *, to_stderr: bool = False) -> None:
    (stderr_console() if to_stderr else stdout_console()).print(renderable)


def render_to_text(renderable: Any, width: int = GOLDEN_WIDTH) -> str:
    """Render at a fixed width without colour: what golden-file tests compare."""
    con = Console(width=width, record=True, file=open(os.devnull, "w"), color_system=None, highlight=False)
    con.print(renderable)
    return con.export_text()


@contextlib.contextmanager
def progress(enabled: bool = True) -> Iterator[Progress]:
    """A progress display on stderr (disabled: the same object, nothing drawn)."""
    p = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
        console=stderr_console(), disable=not enabled, transient=False,
    )
    with p:
        yield p
