"""The CLI's outer contract: version, help, usage errors, the no-traceback rule."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.paths import REPO
from v100plan.errors import EXIT_BAD_INPUT, BadInput
from v100plan.units import format_tokens, parse_tokens


def test_version(cli):
    r = cli("--version")
    assert r.exit_code == 0
    assert r.stdout.startswith("v100plan ")


@pytest.mark.parametrize(
    "text, tokens",
    [("186000", 186000), ("186K", 190464), ("186k", 190464), ("256K", 262144), ("1M", 1048576), (8192, 8192)],
)
def test_parse_tokens(text, tokens):
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize("text", ["-5", "0", "abc", "1.5", "12Q", ""])
def test_parse_tokens_rejects(text):
    with pytest.raises(BadInput):
        parse_tokens(text)


def test_format_tokens():
    assert format_tokens(262144) == "256K"
    assert format_tokens(1000) == "1000"


def test_console_script_runs_as_a_process():
    """The installed entry point works outside the test runner (python -m v100plan)."""
    r = subprocess.run([sys.executable, "-m", "v100plan", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "v100plan" in r.stdout


def test_exit_code_table_is_documented():

    from v100plan.errors import EXIT_CODES

    readme = (REPO / "README.md").read_text()
    for code in EXIT_CODES:
        assert f"| {code} |" in readme, f"exit code {code} is missing from README.md's table"
    assert EXIT_BAD_INPUT == 2


def test_control_plane_imports_no_gpu_library():
    """Loading every command must not pull torch, pynvml or cupy (STYLE.md habit 1)."""
    code = (
        "import sys, v100plan.cli; "
        "bad = [m for m in ('torch', 'pynvml', 'cupy', 'numpy') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"control plane imported {r.stdout.strip()} at load time"
