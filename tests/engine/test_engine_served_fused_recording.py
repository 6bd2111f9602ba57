"""The two-H200 recording with the fused decode kernels (2026-11-30, `python -m engine.bench.served`, one run,
tests/fixtures/multigpu/record-h200x2-run4.sh): the served-speed targets, judged on CPU. Every ratio is
recomputed from the figures beside it; what was met and what was missed is asserted as recorded
(docs/engine-speed.md, "Two H200s with the fused kernels")."""

from __future__ import annotations

import json

import pytest

from tests import pytest_log, served_checks
from tests.conftest import FIXTURES

MULTI = FIXTURES / "multigpu"
SERVED = MULTI / "h200x2-served-qwen3-fused-2026-11-30.json"
BENCH = MULTI / "h200x2-bench-tp2-qwen3-fused-2026-11-30.json"  # the bench-tp2 run inside SERVED's run
GEMV_SERVED = MULTI / "h200x2-served-qwen3-gemv-2026-11-30.json"  # the same command before the fused kernels
GPU_TESTS = MULTI / "h200x2-gpu-tests-fused-2026-11-30.txt"

served, bench = served_checks.recording_fixtures(SERVED, BENCH)


def test_two_h200s_serving_the_qwen3_8b_shape_with_the_fused_kernels(served, bench):
    served_checks.two_h200s_on_the_qwen3_8b_shape(served, bench)
    assert bench["summary"]["tp1"]["kernels"] == "fused"
    served_checks.both_ranks_fused_graphs_on_the_mailbox(served)
    lines = [ln for ln in served["rank_log"] if ln.startswith("[rank 1] decode graphs (")]  # the log's tail: rank 1
    assert lines and "kernels fused (five Triton kernels per layer" in lines[-1]


def test_tp1_step_reads_at_80_percent_of_the_measured_bandwidth(bench):
    assert served_checks.tp1_read_bw_fraction(bench) >= 0.80  # the TP1 target (80 % of read bandwidth), met: 80.7 %


def test_served_within_10_percent_of_the_bench_step(served, bench):
    assert served_checks.served_vs_bench(served, bench) >= 0.90  # met: 2.97 ms served vs 2.83 ms bench


def test_tp2_over_tp1_recorded_short_of_the_target(bench, served):
    s = bench["summary"]
    gm = s["device_mailbox_graph"]
    assert gm["tp2_vs_tp1_bench"] == pytest.approx(s["tp1"]["step_ms"] / gm["step_ms"], abs=1e-4)
    assert gm["step_ms"] < s["nccl"]["step_ms"]
    # Recorded as missed (docs/engine-speed.md says where the rest is): 1.54x against the target 1.6x;
    # more than the cuBLAS/compiled run's 1.42x and the Triton GEMV run's 1.47x.
    assert 1.5 < gm["tp2_vs_tp1_bench"] < 1.6
    before = json.loads(GEMV_SERVED.read_text())["ratios"]
    assert gm["tp2_vs_tp1_bench"] > before["tp2_vs_tp1_bench"]
    assert served["ratios"]["served_ms_per_token"] < before["served_ms_per_token"]


def test_race_picked_the_fastest_captured_path(bench):
    assert served_checks.race_picked_fastest(bench) == "device_mailbox_graph"


def test_one_sse_event_per_token_at_the_step_rate(served):
    served_checks.sse_one_event_per_token(served, skip_first=0)


def test_the_gpu_tests_with_the_fused_kernels_passed_on_the_two_h200s():
    text = GPU_TESTS.read_text()
    assert pytest_log.outcome_counts(text) == {"passed": 9}
    for name in ("test_graph_replays_equal_eager_steps[fused]",
                 "test_ranks_capture_the_step_with_the_allreduce_inside_and_match_tp1",
                 "test_lockstep_in_the_graph_on_two_gpus", "test_auto_on_two_gpus_trusts_the_race",
                 "test_on_the_gpu_fused_steps_match_the_plain_step_in_bf16_and_in_a_graph"):
        assert name in text
