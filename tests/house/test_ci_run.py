"""`.ci/run` itself, run against stand-in pip/ruff/python executables: it takes torch's CPU build (never
PyPI's CUDA torch), and when the engines' parser install fails it shows pip's own error and stops."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

# A pip that records its arguments; the --target install (the engines' parsers) fails as a real one would.
FAKE_PIP = """#!/bin/sh
echo "$@" >> "$CALLS"
case "$*" in *--target*) echo "ERROR: No matching distribution found for vllm==0.0.0" >&2; exit 1;; esac
exit 0
"""
OK = "#!/bin/sh\nexit 0\n"


@pytest.mark.skipif(not Path("/usr/sbin/sshd").exists(), reason="needs /usr/sbin/sshd, as .ci/run does")
def test_ci_run_takes_cpu_torch_and_shows_a_failed_parser_install(tmp_path):
    (tmp_path / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "run", tmp_path / ".ci" / "run")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("pip", FAKE_PIP), ("ruff", OK), ("python", OK)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    tools = tmp_path / "tools"  # chromium, rsync and crontab present, so no apt-get runs
    tools.mkdir()
    for name in ("chromium", "rsync", "crontab"):
        (tools / name).write_text(OK)
        (tools / name).chmod(0o755)
    calls = tmp_path / "calls"
    r = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "CALLS": str(calls)})
    assert r.returncode != 0
    assert "No matching distribution found for vllm==0.0.0" in r.stderr
    torch_installs = [line for line in calls.read_text().splitlines() if " torch==" in f" {line}"]
    assert torch_installs and all("torch==2.13.0+cpu" in line for line in torch_installs), torch_installs
    # the first try is pip's configured sources (a local CPU wheel through find-links, its dependencies from the
    # index); PyTorch's CPU index only when that fails (here it did not)
    assert len(torch_installs) == 1 and "--index-url" not in torch_installs[0] and "--no-index" not in torch_installs[0]
