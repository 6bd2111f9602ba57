"""Shared fixtures. Each test gets its own V100PLAN_HOME (one environment variable
decides where v100plan keeps state), a fixed console width and scrubbed hostnames,
so outputs are reproducible and nothing touches the user's home."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def gpu_available() -> bool:
    if os.environ.get("V100PLAN_GPU_TESTS") == "1":
        return True
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_finish(session):
    """Start the children of the tests that will run and take ``@pytest.mark.early(spec)`` (tests/early.py), in
    the order of those tests, in the background; a test skipped by its skipif marker starts none."""
    from tests import early

    specs = []
    for item in session.items:
        if any(m.name == "skip" or (m.name == "skipif" and m.args and m.args[0] is True) for m in item.iter_markers()):
            continue
        specs += [m.args[0] for m in item.iter_markers("early")]
    if specs:
        early.start(specs)


def pytest_sessionfinish(session):
    from tests import early

    early.stop()


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (runs on the lent device, not in CI)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("v100plan-home")
    monkeypatch.setenv("V100PLAN_HOME", str(home))
    monkeypatch.setenv("V100PLAN_WIDTH", "120")
    monkeypatch.setenv("V100PLAN_SCRUB_HOST", "1")
    monkeypatch.delenv("V100PLAN_DEBUG", raising=False)
    return home


class Cli:
    """Runs the real typer app in-process and returns (exit code, stdout, stderr)."""

    def __init__(self):
        from v100plan.cli import app

        self.app = app
        self.runner = CliRunner()

    def __call__(self, *args: str):
        result = self.runner.invoke(self.app, [str(a) for a in args], catch_exceptions=True)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return result

    def json(self, *args: str):
        result = self(*args, "--json")
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)


@pytest.fixture
def cli() -> Cli:
    return Cli()
