"""MTP speculation's captured rounds on one H200 (nvidia-h200, 2026-12-02, `bash docs/h200_spec_run.sh`):
`python -m engine.bench.mtp --layers 8,16 --context 4096` on the 27B hybrid shape (random bf16 weights) with
its figures projected to 64 layers, and `generate` with and without speculation on the MTP demo
(tests/fixtures/engine/h200-mtp-2026-12-02.json, h200-mtp-generate-2026-12-02.txt). Judged by what was
measured: the times of the two depths, the projection through them, the round arithmetic, the tokens."""

from __future__ import annotations

import json

import pytest

from engine.bench import mtp
from tests.paths import FIXTURES

REC = json.loads((FIXTURES / "engine" / "h200-mtp-2026-12-02.json").read_text())


def test_the_recording_is_the_27b_shape_on_an_h200_at_two_depths():
    assert REC["device"] == "NVIDIA H200" and REC["dtype"] == "bfloat16" and REC["config"] == "qwen3.5-27b.config.json"
    assert [r["layers"] for r in REC["runs"]] == [8, 16] and REC["full_depth"]["layers"] == 64
    for run in REC["runs"]:
        assert run["kernels"] == "fused"  # the kernels the service runs
        for k, row in run["K"].items():  # each depth's own figures
            assert row["verify_over_step"] == pytest.approx(row["verify_ms"] / run["step_ms"], abs=2e-3)
            assert row["verify_ms"] > run["step_ms"], k  # K + 1 positions cost more than one


def test_the_projection_goes_through_both_depths():
    a, b = REC["runs"]
    full = REC["full_depth"]
    per_layer = (b["step_ms"] - a["step_ms"]) / (b["layers"] - a["layers"])
    assert full["step_ms"] == pytest.approx(a["step_ms"] + per_layer * (64 - a["layers"]), rel=1e-3)
    for k in ("1", "2", "3", "4"):
        va, vb = a["K"][k]["verify_ms"], b["K"][k]["verify_ms"]
        want = va + (vb - va) / (b["layers"] - a["layers"]) * (64 - a["layers"])
        assert full["K"][k]["verify_ms"] == pytest.approx(want, rel=1e-3)


def test_verifying_four_positions_costs_under_1_3_steps_and_speculation_pays_at_both_rates():
    full = REC["full_depth"]
    step = full["step_ms"]
    for k, row in full["K"].items():
        assert row["verify_over_step"] == pytest.approx(row["verify_ms"] / step, abs=2e-3)
        again = mtp.rates(step, {"draft_ms": {int(j): v for j, v in row["draft_ms"].items()},
                                 "verify_ms": row["verify_ms"], "rollback_ms": row["rollback_ms"]}, int(k))
        for rate in ("0.745", "0.49"):  # the round arithmetic, recomputed from the measured parts
            assert row["at_rates"][rate]["tok_s"] == pytest.approx(again[rate]["tok_s"], rel=1e-3)
    assert full["K"]["3"]["verify_over_step"] <= 1.3  # K + 1 = 4 positions
    best = {rate: max(r["at_rates"][rate]["speedup"] for r in full["K"].values()) for rate in ("0.745", "0.49")}
    assert best["0.745"] > 1.5 and best["0.49"] > 1.2


def test_greedy_speculation_gave_one_token_decodings_tokens_in_float32_on_the_gpu():
    lines = (FIXTURES / "engine" / "h200-mtp-generate-2026-12-02.txt").read_text().splitlines()
    runs = {}
    for line in lines:
        label, _, doc = line.partition(": ")
        runs[label] = json.loads(doc)
    assert runs["float32 off"]["token_ids"] == runs["float32 mtp"]["token_ids"]
    assert len(runs["float32 mtp"]["token_ids"]) == 48 and runs["float32 mtp"]["spec"]["draft_tokens"] > 0
