"""The control plane's layers stay straight: what imports what, one identify() for cards, hardware figures
only from the catalogue, and probe cases that declare what they need so `--only` works alone."""

from __future__ import annotations

import ast
import copy
import re
from pathlib import Path

import pytest

from probes import cases, nvml, replay, runner
from probes.context import Options, ProbeContext
from tests.conftest import FIXTURES, REPO
from v100plan import catalogue, probe_judge
from v100plan.planner.from_probe import hardware_from_probe

PACKAGE = REPO / "v100plan"


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-local imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def _module(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _importers_of_commands() -> dict[str, list[str]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module(path)
        if name == "v100plan.cli" or name.startswith("v100plan.commands"):
            continue
        bad = sorted(m for m in _imports(path) if m.startswith("v100plan.commands"))
        if bad:
            out[name] = bad
    return out


def test_only_the_cli_imports_commands():
    bad = _importers_of_commands()
    assert not bad, f"domain code must not depend on the CLI: {bad}"


def test_calibrate_has_no_import_cycle():
    modules = {_module(p): p for p in (PACKAGE / "calibrate").glob("*.py")}
    graph = {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}
    state: dict[str, str] = {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = "open"
        for n in graph[m]:
            assert state.get(n) != "open", f"import cycle: {' -> '.join(trail + [m, n])}"
            if n not in state:
                visit(n, trail + [m])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [])
    assert len(modules) >= 6  # fit, views, single, tp2_fit, tp2_profile, tp2_compare (+ __init__)


def test_no_hardware_figure_is_hard_coded_in_the_commands():
    """Peaks and datasheet names come from profiles/hardware/, where each has its source."""
    for path in (PACKAGE / "commands").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"\b989\.5\b|datasheet|\"h200\"", text, re.IGNORECASE), path.name


def _shared_device_id_profiles() -> list[dict]:
    """Two profiles of one PCI device id that differ in memory size and memory clock."""
    a = copy.deepcopy(catalogue.get("hardware", "v100-pcie-32gb"))
    b = copy.deepcopy(catalogue.get("hardware", "v100-pg500-216"))
    b["pci_device_ids"] = list(a["pci_device_ids"])
    b["pci_subsystem_ids"], a["pci_subsystem_ids"] = [], []
    b["memory_gib"], a["memory_gib"] = 32.0, 16.0
    return [a, b]


@pytest.mark.parametrize("memory_gib, want", [(31.7, 1), (15.8, 0)])
def test_probe_verdicts_and_planner_name_the_same_card(memory_gib, want):
    """One identify(): the verdict table and the plan never call one card two SKUs."""
    profiles = _shared_device_id_profiles()
    card = {"index": 0, "name": "V100", "pci_device_id": profiles[0]["pci_device_ids"][0], "pci_subsystem_id": "",
            "memory_total_gib": memory_gib, "mem_clock_max_mhz": profiles[want].get("mem_clock_max_mhz")}
    judged, _ = probe_judge.identify(card, profiles)
    report = {"cards": [card], "pairs": [], "host": {}}
    planned = hardware_from_probe(report, profiles, "test", 1)
    assert judged["id"] == profiles[want]["id"]
    assert f"catalogue profile {judged['id']}" in " ".join(planned.notes)


def test_each_need_is_a_registered_case_ordered_before_it():
    registry = cases.registry()
    keys = [c.key for c in registry]
    needing = [c for c in registry if c.needs]
    assert {c.key for c in needing} >= {"p2p", "throttle", "software_stack"}
    for c in needing:
        for n in c.needs:
            assert keys.index(n) < keys.index(c.key)


def test_only_p2p_runs_the_inventory_it_reads():
    """`--only p2p` alone: the runner runs inventory first, so the NVLink state p2p reads is there.

    Against NVML answers recorded on the lent H200 (one card: p2p itself is then waived)."""
    nvml.reset_for_tests(replay.load(FIXTURES / "probes" / "h200-nvml-answers.json"))
    try:
        from probes import inventory

        ctx = ProbeContext(Options.for_mode("quick", only=("p2p",)))
        inventory.discover(ctx)
        p2p = [c for c in cases.registry() if c.key == "p2p"]
        results = runner.run_cases(p2p, ctx)
    finally:
        nvml.reset_for_tests(None)
    assert [r.key for r in results] == ["inventory", "p2p"]
    assert results[0].status == "passed", results[0].reason
    assert results[1].status == "waived" and "one card" in results[1].reason
    card = ctx.cards[0].values
    assert "nvlink" in card and card["pci_device_id"] == "10de:2335"


def test_command_modules_are_only_the_cli():
    """Each command module declares, validates, calls the library once and renders: it stays short and
    takes nothing private from another command module (shared pieces live in a library module)."""
    for path in (PACKAGE / "commands").glob("*.py"):
        assert len(path.read_text().splitlines()) <= 250, f"{path.name} holds more than a command's CLI"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("v100plan.commands"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"
