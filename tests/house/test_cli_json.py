"""Every command that shows a document takes --json and prints one registered, schema-valid document with
provenance; every command and option has help text, and `python -m engine` says what its options default to."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from profiles.document import SCHEMA_VERSIONS
from tests.conftest import FIXTURES, REPO
from v100plan import documents

PROBE = FIXTURES / "probes" / "h200-probe-quick.json"
BENCH_TP2 = FIXTURES / "multigpu" / "h200x2-bench-tp2.json"
PROBE_X2 = FIXTURES / "multigpu" / "h200x2-probe-quick.json"

DOCUMENT_COMMANDS = {
    "plan": (["plan"], "plan"),
    "compare": (["compare", "h200x2", "v100-pg500-216x2"], "comparison"),
    "profiles list": (["profiles", "list"], "catalogue_listing"),
    "profiles show": (["profiles", "show", "ninfer-v100-tp"], "engine_profile"),
    "profiles validate": (["profiles", "validate"], "validation_report"),
    "probe --from": (["probe", "--from", str(PROBE)], "probe_report"),
    "bench probes --from": (["bench", "probes", "--from", str(PROBE)], "probe_bench"),
    "bench tp2 --from": (["bench", "tp2", "--from", str(BENCH_TP2), "--probe", str(PROBE_X2)], "tp2_bench"),
}


@pytest.mark.parametrize("name", sorted(DOCUMENT_COMMANDS))
def test_json_is_one_registered_document_with_provenance(cli, name):
    argv, kind = DOCUMENT_COMMANDS[name]
    r = cli(*argv, "--json")
    assert r.exit_code in (0, 1), r.stderr  # 1: the recorded probe has a failed check; its document still prints
    doc = json.loads(r.stdout)  # exactly one document: anything else on stdout breaks this
    assert doc["kind"] == kind and kind in SCHEMA_VERSIONS
    assert doc["provenance"]["tool"] == "v100plan" and doc["provenance"]["created_utc"]
    documents.validate(doc, kind, source=name)


def _commands(group, prefix=()):
    import typer.main

    click_group = typer.main.get_command(group) if not hasattr(group, "commands") else group
    for name, cmd in click_group.commands.items():
        if hasattr(cmd, "commands"):
            yield from _commands(cmd, (*prefix, name))
        else:
            yield (*prefix, name), cmd


def test_every_command_and_option_has_help():
    from v100plan.cli import app

    seen, missing = 0, []
    for path, cmd in _commands(app):
        seen += 1
        name = f"v100plan {' '.join(path)}"
        if not (cmd.help or "").strip():
            missing.append(name)
        for p in cmd.params:
            if "--help" in getattr(p, "opts", []):
                continue
            if not (getattr(p, "help", None) or "").strip():
                missing.append(f"{name} {'/'.join(p.opts) if p.param_type_name == 'option' else p.name}")
    assert not missing, "no help text: " + "; ".join(missing)
    assert seen >= 8


def test_root_help_lists_only_registered_commands(cli):
    """The description promises nothing by name: every command in the list is one that exists."""
    from v100plan.cli import app

    r = cli("--help")
    assert r.exit_code == 0
    text = " ".join(r.stdout.split())
    assert "deploy and accept" not in text
    names = {path[0] for path, _ in _commands(app)}
    for name in names:
        assert f" {name} " in text


def test_root_help_does_not_cut_command_summaries(cli):
    r = cli("--help")
    commands = r.stdout.split("Commands")[-1]
    assert "..." not in commands, commands


def test_engine_generate_help_describes_every_option_with_its_default():
    r = subprocess.run([sys.executable, "-m", "engine", "generate", "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for option in ("--model", "--tp", "--prompt", "--prompt-ids", "--max-tokens", "--temperature", "--top-p", "--seed",
                   "--stop-at-eos", "--device", "--dtype", "--allreduce", "--max-context", "--json"):
        assert option in text
    for default in ("(default: 1)", "(default: 16)", "(default: 0.0)", "(default: 1.0)", "(default: cpu)",
                    "(default: auto)"):
        assert default in text, default
    assert "max_position_embeddings" in text and "Exit codes" in text


def test_engine_usage_lists_every_command_and_how_to_get_its_options():
    from engine.__main__ import COMMANDS

    r = subprocess.run([sys.executable, "-m", "engine", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for name in COMMANDS:
        assert f"  {name} " in r.stdout
    assert "--help" in r.stdout and "130" in r.stdout
