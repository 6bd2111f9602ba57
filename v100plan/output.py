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
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
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
    """A hint or note for a person: always stderr, so stdout stays machine-readable.

    The text is printed as written: brackets in it (``v100plan[engine]``, a regex) are not markup.
    """
    stderr_console().print(text, markup=False)


def error(message: str, hint_text: str | None = None) -> None:
    """``Error: message`` and ``Hint: hint`` on stderr; user text is escaped, never read as markup."""
    con = stderr_console()
    con.print(f"[bold red]Error:[/] {escape(message)}", markup=True, highlight=False)
    if hint_text:
        con.print(f"[dim]Hint:[/] {escape(hint_text)}", markup=True, highlight=False)


def check_out(path: str | os.PathLike[str] | None, option: str = "--out") -> Path | None:
    """Refuse an output path that cannot be written, before any work is done.

    A missing parent directory is created (as `qualify --out` creates its directory). A directory, a
    parent that cannot be created or one without write permission is bad input (exit 2) named after
    ``option``; None passes through.
    """
    from v100plan.errors import BadInput

    if path is None:
        return None
    p = Path(path)
    hint_text = f"give {option} a file path in a writable directory, e.g. {option} plan.json"
    if p.is_dir():
        raise BadInput(f"{option} {str(p)!r} is a directory, not a file", hint=hint_text)
    parent = p.parent if str(p.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"{option} {str(p)!r}: directory {str(parent)!r} cannot be created: {e.strerror or e}",
                       hint=hint_text) from None
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise BadInput(f"{option} {str(p)!r} is not writable", hint=hint_text)
    return p


def write_json(path: str | os.PathLike[str] | None, doc: Any, option: str = "--out", indent: int = 2) -> None:
    """Write ``doc`` as JSON to ``path`` (checked first; a failed write is an environment problem)."""
    from v100plan.errors import EnvironmentProblem

    p = check_out(path, option)
    if p is None:
        return
    try:
        p.write_text(json.dumps(doc, indent=indent, default=_json_default) + "\n")
    except OSError as e:
        raise EnvironmentProblem(f"{option} {str(p)!r} could not be written: {e.strerror or e}",
                                 hint="check the disk space and permissions there") from None


def table(
    title: str | None,
    columns: Sequence[str | tuple[str, str]],
    rows: Iterable[Sequence[Any]],
    caption: str | None = None,
) -> Table:
    """A rich Table. ``columns`` items are a header or (header, justify)."""
    t = Table(title=escape(title) if title else None, caption=escape(caption) if caption else None,
              title_justify="left", caption_justify="left")
    for col in columns:
        header, justify = (col, "left") if isinstance(col, str) else col
        t.add_column(escape(header), justify=justify)  # type: ignore[arg-type]
    for row in rows:
        # Cells carry user text (file names, regex patterns, hardware ids): never markup.
        t.add_row(*("—" if v is None else escape(str(v)) for v in row))
    return t


def render(renderable: Any, *, to_stderr: bool = False) -> None:
    """Print a table or a line of text; a plain string is printed as written (brackets are not markup)."""
    (stderr_console() if to_stderr else stdout_console()).print(renderable, markup=False)


def render_to_text(renderable: Any, width: int = GOLDEN_WIDTH) -> str:
    """Render at a fixed width without colour: what golden-file tests compare."""
    with open(os.devnull, "w") as sink:
        con = Console(width=width, record=True, file=sink, color_system=None, highlight=False)
        con.print(renderable, markup=False)
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
