"""Options shared by several commands, as Annotated aliases (one definition each)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout (tables go to stderr).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print only the result, no tables or hints.")]
OutOpt = Annotated[Optional[str], typer.Option("--out", "-o", help="Also write the JSON document to this file.")]
