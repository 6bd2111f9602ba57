"""Golden renderings of what people read: the verdict tables for recorded reports.

Refresh on purpose only: V100PLAN_UPDATE_GOLDEN=1 pytest tests/probes/test_probe_render.py
"""

from __future__ import annotations

import json

import pytest

from tests import golden_files
from tests.conftest import FIXTURES
from v100plan import catalogue, output, probe_judge
from v100plan.commands.probe import verdict_tables

PROBES = FIXTURES / "probes"


@pytest.mark.parametrize("name", ["h200-probe-quick", "facts-pg500-216-pair-broken-p2p",
                                  "facts-sxm2-pair-nvlink-hot-card1"])
def test_verdict_tables_match_golden(name):
    report = json.loads((PROBES / f"{name}.json").read_text())
    judgement = probe_judge.judge(report, catalogue.all_of("hardware"))
    text = "".join(output.render_to_text(t) for t in verdict_tables(judgement, judgement.report))
    golden_files.check(PROBES / "golden" / f"{name}.txt", text)
