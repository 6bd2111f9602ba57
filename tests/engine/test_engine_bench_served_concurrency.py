"""engine.bench.served_concurrency: its arithmetic, and one run end to end on CPU (a real serve of the hybrid demo,
two CPU ranks, requests released together over HTTP). Its figures are only worth reading on a GPU pair; here the
test checks that every request came back whole and that the document's figures follow from its own walls."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.bench import served_concurrency as sc
from tests.engine_helpers import REPO


def test_per_request_ms_cancels_the_prefill_and_aggregate_counts_every_request():
    assert sc.per_request_ms([1.0, 1.2, 1.1], [2.1, 2.0, 2.2], 16, 116) == pytest.approx(10.0)
    f = sc.figures({1: 20.0, 8: 40.0})
    assert f["8"]["aggregate_tok_s"] == pytest.approx(200.0) and f["8"]["per_request_tok_s"] == pytest.approx(25.0)
    assert f["8"]["aggregate_over_1"] == pytest.approx(4.0) and f["8"]["per_request_over_1"] == pytest.approx(0.5)
    assert "aggregate_over_1" not in sc.figures({2: 10.0})["2"]


def test_gaps_split_at_the_other_prompt_s_send_and_answer():
    g = sc.gaps([0, 10, 20, 100, 190, 200, 210], 25, 195)
    assert g["before"]["n"] == 2 and g["before"]["max_ms"] == 10
    assert g["during_prefill"]["n"] == 3 and g["during_prefill"]["max_ms"] == 90  # 20->100, 100->190, 190->200
    assert sc.gaps([0, 5], 10, None)["during_prefill"]["n"] == 0


def test_bad_arguments_exit_2_with_a_message():
    for argv, says in ((["--batches", "0,2"], "between 1 and 64"), (["--short", "20", "--long", "10"], "--short"),
                       (["--max-context", "100"], "--max-context 100 must exceed")):
        r = subprocess.run([sys.executable, "-m", "engine.bench.served_concurrency", *argv], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_cpu_run_serves_every_request_whole_and_its_figures_follow_from_its_walls(mtp_demo_dir, tmp_path):
    out = tmp_path / "sc.json"
    r = subprocess.run([sys.executable, "-m", "engine.bench.served_concurrency", "--model", str(mtp_demo_dir),
                        "--devices", "cpu,cpu", "--dtype", "float32", "--batches", "1,2", "--prompt-tokens", "20",
                        "--short", "4", "--long", "20", "--rounds", "2", "--max-context", "1024",
                        "--interfere-tokens", "600", "--interfere-after", "3", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["health"]["max_concurrency"] == 2 and "--max-concurrency 2" in doc["serve_command"]
    for c in (1, 2):
        walls = doc["walls"][str(c)]
        assert len(walls["short_s"]) == len(walls["long_s"]) == 2 * c  # every request answered (whole: checked)
        ms = sc.per_request_ms(walls["short_s"], walls["long_s"], 4, 20)
        assert doc["served"][str(c)]["per_request_ms_per_token"] == pytest.approx(ms, abs=1e-3)
        assert doc["served"][str(c)]["aggregate_tok_s"] == pytest.approx(c * 1000 / ms, rel=1e-3)
    p = doc["prefill_interference"]
    assert p["stream_tokens"] >= 20 and p["answered_at_ms"] > p["sent_at_ms"] > 0
    assert p["during_prefill"]["n"] >= 1  # the stream went on while the long prompt was prefilled
