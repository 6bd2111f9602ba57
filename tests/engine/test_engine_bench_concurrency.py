"""engine.bench.concurrency's CPU-checkable parts: the floor written before timing, the targets computed from the
timed rows, the agreement check on a real (demo hybrid) model, and its argument errors. The timing runs on a GPU."""

import subprocess
import sys

import pytest

from engine.bench import concurrency
from engine.core import config as ecfg
from engine.core import demo, weights
from engine.core.model import Model


def test_the_floor_reads_the_weights_once_and_each_sequence_apart():
    p = concurrency.predictions(50_000_000_000, 500_000_000, [1, 8], 3000.0)
    assert p["1"]["floor_ms"] == pytest.approx(50.5e9 / 3e12 * 1e3, rel=1e-4)
    assert p["8"]["floor_ms"] == pytest.approx(54e9 / 3e12 * 1e3, rel=1e-4)
    assert p["8"]["floor_step_ratio"] == pytest.approx(54 / 50.5, rel=1e-3)
    assert p["8"]["floor_aggregate_tok_s"] == pytest.approx(8 * 1000 / (54e9 / 3e12 * 1e3), rel=1e-3)


def test_targets_judge_c8_against_the_solo_step_when_timed():
    rows = {"1": {"aggregate_tok_s": 30.0, "per_request_tok_s": 30.0},
            "8": {"aggregate_tok_s": 200.0, "per_request_tok_s": 25.0}}
    t = concurrency.targets({**rows, "16": {"error": "no graph for 16 rows at window 4096"}}, solo_tok_s=45.0)
    assert t["c"] == 8 and t["aggregate_over_batched_1"] == pytest.approx(6.667, abs=1e-3)
    assert t["aggregate_over_solo"] == pytest.approx(4.444, abs=1e-3)
    assert t["aggregate_target_5x_met"] is False  # judged against the faster solo step
    assert t["per_request_target_60pct_met"] is False  # 25 / 45 = 0.556
    alone = concurrency.targets(rows, None)  # no solo step timed: against the batched C = 1
    assert alone["aggregate_target_5x_met"] is True and alone["per_request_target_60pct_met"] is True  # 0.83
    assert concurrency.targets({"1": rows["1"]}, 45.0) == {}


def test_agreement_on_float32_is_exact(tmp_path):
    demo.make(tmp_path, arch="qwen3_5")
    m = Model(ecfg.load(tmp_path))
    weights.load_into(m, tmp_path)
    m.setup_cache(512, slots=3)
    got = concurrency.agreement(m, 3, 8, prompt=6)
    assert got == {"c": 3, "steps": 8, "tokens_equal_fraction": 1.0, "first_difference_at": [None] * 3,
                   "sequences_identical": 3}


def test_bad_batches_exit_2_with_a_message():
    r = subprocess.run([sys.executable, "-m", "engine.bench.concurrency", "--batches", "0,8"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "between 1 and 64" in r.stderr and "Traceback" not in r.stderr
