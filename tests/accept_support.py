"""Helpers for the acceptance tests (no tests here): run the real CLI as a process and read
what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLANTED_ENV = {"V100PLAN_TEST_API_TOKEN": "tok-planted-7f3e9a1c55d0", "HF_TOKEN": "hf_plantedPlanted1234"}


def run_cli(*args: str, timeout_s: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "v100plan", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s, env={**os.environ, **PLANTED_ENV, **(env or {})})


def outputs(out_dir: Path) -> dict[str, str]:
    return {name: (out_dir / name).read_text() for name in ("report.json", "report.html", "junit.xml")}


def report(out_dir: Path) -> dict:
    return json.loads((out_dir / "report.json").read_text())


def assert_no_secret(out_dir: Path, *secrets: str) -> None:
    for name, text in outputs(out_dir).items():
        for s in (*secrets, *PLANTED_ENV.values()):
            assert s not in text, f"a secret leaked into {name}"


def scenario(doc: dict, key: str) -> dict:
    return next(s for s in doc["scenarios"] if s["key"] == key)
