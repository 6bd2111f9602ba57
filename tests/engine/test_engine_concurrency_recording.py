"""The batched step measured on the lent H100 (2026-12-06, docs/concurrency_run.sh: python -m engine.bench.concurrency,
27B hybrid shape, bf16, 4K; recordings in tests/fixtures/engine/), judged through the bench's own code: the issue's
ratios recomputed from the recorded milliseconds, the kernels against the torch forms of the same call, and the
planner's batched-step table (profiles/engines/v100plan.json) holding exactly what was measured."""

from __future__ import annotations

import json

import pytest

from engine.bench import concurrency
from tests.paths import REPO

FIX = REPO / "tests" / "fixtures" / "engine"


@pytest.fixture(scope="module")
def kernels() -> dict:
    return json.loads((FIX / "h100-concurrency-bf16-4k-2026-12-06.json").read_text())


def test_the_recorded_step_meets_the_issues_targets_recomputed_from_its_milliseconds(kernels):
    assert "H100" in kernels["device"] and kernels["num_layers"] == 64 and kernels["context"] == 4096
    assert kernels["rows_attention_and_gdn"] == "kernels"
    batched = kernels["batched"]
    for c, row in batched.items():  # each figure from its own milliseconds
        assert row["aggregate_tok_s"] == pytest.approx(int(c) * 1000 / row["ms"], rel=1e-3)
        assert row["ms"] < row["eager_ms"], c  # the graph replay (what the service runs) beats the eager launches
    got = concurrency.targets(batched, kernels["solo"]["tok_s"])
    assert got == kernels["targets"]
    assert got["aggregate_over_solo"] >= 5 and got["per_request_over_solo"] >= 0.6
    assert batched["8"]["ms"] / batched["1"]["ms"] <= 1.6


def test_the_kernels_beat_the_torch_forms_timed_in_the_same_call(kernels):
    torch_forms = json.loads((FIX / "h100-concurrency-bf16-4k-torch-forms-2026-12-06.json").read_text())
    assert torch_forms["rows_attention_and_gdn"] == "torch" and torch_forms["device"] == kernels["device"]
    for c in ("1", "8"):
        assert kernels["batched"][c]["ms"] < 0.8 * torch_forms["batched"][c]["ms"], c


def test_the_planners_bf16_table_is_the_recording(kernels):
    table = json.loads((REPO / "profiles" / "engines" / "v100plan.json").read_text())["batched_step"]
    (row,) = table["families"]["bf16"]["contexts"]
    assert row["context_tokens"] == kernels["context"]
    assert row["solo_ms"] == pytest.approx(kernels["solo"]["ms"], abs=0.005)
    assert {int(c): ms for c, ms in row["step_ms"].items()} == pytest.approx(
        {int(c): v["ms"] for c, v in kernels["batched"].items()}, abs=0.005)
