"""Writing an AcceptanceReport to disk: report.json, report.html and junit.xml in one directory.

The document is validated against acceptance_report.schema.json (and the ProbeReport
and Plan it embeds against theirs) before anything is written, so a renderer only
ever sees a well-formed document and a bad one is a DocumentError (exit 2), not a
half-written directory. Each file is written to a temporary name and renamed into
place; nothing but the document and its renderings is written.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from v100plan.documents import problems, validate
from v100plan.errors import BadInput, DocumentError
from v100plan.report.html import render_html
from v100plan.report.junit import render_junit

FILES = {"json": "report.json", "html": "report.html", "junit": "junit.xml"}


def validate_report(report: Any, source: str = "<acceptance report>") -> dict[str, Any]:
    """The report if it is a valid acceptance_report with valid embedded probe and plan, else DocumentError."""
    validate(report, "acceptance_report", source=source)
    for field, kind in (("probe", "probe_report"), ("plan", "plan")):
        if report[field] is not None:
            found = problems(report[field], kind)
            if found:
                path, what = found[0]
                raise DocumentError(source, f"embedded {kind}: {what}", json_path="$." + field + path[1:])
    return report


def _write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_reports(report: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Validate ``report`` and write it as JSON, HTML and JUnit XML under ``out_dir`` (created if needed).

    Returns {"json": path, "html": path, "junit": path}.
    """
    validate_report(report)
    out_dir = Path(out_dir)
    rendered = {"json": json.dumps(report, indent=2, ensure_ascii=False) + "\n",
                "html": render_html(report), "junit": render_junit(report)}
    if out_dir.exists() and not out_dir.is_dir():
        raise BadInput(f"{out_dir} exists and is not a directory; the reports need a directory",
                       hint="give a directory path (it is created when missing)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = {}
        for what, name in FILES.items():
            paths[what] = out_dir / name
            _write(paths[what], rendered[what])
    except OSError as e:
        raise BadInput(f"cannot write the reports to {out_dir}: {e.strerror or e}",
                       hint="give a directory you can write to") from None
    return paths
