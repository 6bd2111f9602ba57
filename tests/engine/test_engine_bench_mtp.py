"""engine.bench.mtp's arithmetic (expected tokens per round, the accepted-count distribution, tok/s at the field's
rates, the projection to the full depth) and its refusals; the timings themselves need a GPU (the lead runs it)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.bench import mtp as bench
from tests.engine_helpers import REPO


@pytest.mark.parametrize("a", [0.0, 0.49, 0.745, 1.0])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_tokens_per_round_is_the_mean_of_the_accepted_distribution_plus_one(a, k):
    dist = bench.accepted_dist(a, k)
    assert sum(dist) == pytest.approx(1.0)
    assert bench.tokens_per_round(a, k) == pytest.approx(sum((j + 1) * p for j, p in enumerate(dist)))
    if a == 0.745 and k == 3:
        assert bench.tokens_per_round(a, k) == pytest.approx((1 - 0.745 ** 4) / 0.255)


def _row(verify: float, draft: float, rollback: float, k: int) -> dict:
    return {"verify_ms": verify, "draft_ms": {r: draft for r in range(1, k + 2)}, "rollback_ms": rollback}


def test_rates_weigh_the_round_by_the_accepted_count_and_compare_with_one_token_decoding():
    got = bench.rates(10.0, _row(12.0, 2.0, 0.5, 3), 3)
    assert got["plain_tok_s"] == 100.0
    a = got["0.745"]
    round_ms = 2.0 + 12.0 + (1 - 0.745 ** 3) * 0.5  # the rollback only where a draft was rejected
    assert a["round_ms"] == pytest.approx(round_ms, abs=1e-4)
    assert a["tok_s"] == pytest.approx(1000 * bench.tokens_per_round(0.745, 3) / round_ms, abs=0.01)
    assert a["speedup"] == pytest.approx(a["tok_s"] / 100.0, abs=1e-3)
    assert got["0.49"]["tok_s"] < a["tok_s"]


def test_the_projection_is_linear_in_the_depth():
    runs = [{"layers": 8, "step_ms": 3.0, "K": {2: _row(4.0, 1.0, 0.1, 2)}},
            {"layers": 16, "step_ms": 5.0, "K": {2: _row(7.0, 1.0, 0.2, 2)}}]
    full = bench.project(runs, 64, [2])
    assert full["step_ms"] == 17.0  # 3 + (5 - 3) x (64 - 8) / 8
    row = full["K"][2]
    assert row["verify_ms"] == 25.0 and row["draft_ms"][1] == 1.0 and row["verify_over_step"] == round(25 / 17, 3)
    assert row["at_rates"]["plain_tok_s"] == round(1000 / 17, 2)


@pytest.mark.parametrize("args, message", [
    (["--draft-tokens", "5"], "--draft-tokens: 1 to 4 each"),
    (["--layers", "8,x"], "comma-separated integers"),
    pytest.param([], "it needs an NVIDIA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the bench runs")),
])
def test_bad_flags_and_no_gpu_exit_2_with_the_reason(args, message):
    proc = subprocess.run([sys.executable, "-m", "engine.bench.mtp", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
