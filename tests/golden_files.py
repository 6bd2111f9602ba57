"""The one golden-file check: compare rendered text with a stored file, rewritten only on purpose
(V100PLAN_UPDATE_GOLDEN=1, then review the diff)."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

UPDATE = "V100PLAN_UPDATE_GOLDEN"


def check(path: Path, text: str) -> None:
    """Assert ``text`` equals the golden file at ``path``; with V100PLAN_UPDATE_GOLDEN=1 write it first."""
    if os.environ.get(UPDATE) == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path}: run with {UPDATE}=1 once and review it"
    want = path.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), str(path), "rendered", n=1))
        raise AssertionError(f"{path.name} changed; refresh with {UPDATE}=1 if intended:\n{diff[:4000]}")
