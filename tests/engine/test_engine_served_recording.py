"""The two-H200 recording of the served-speed work (2026-11-30, `python -m engine.bench.served`, one run): the service
as a user starts it against the bench's own step, judged on CPU. Every ratio is recomputed from the
figures beside it; the targets met and missed are asserted as recorded (docs/engine-speed.md)."""

from __future__ import annotations

import json
import statistics

import pytest

from tests import served_checks
from tests.conftest import FIXTURES

MULTI = FIXTURES / "multigpu"
SERVED = MULTI / "h200x2-served-qwen3-2026-11-30.json"
BENCH = MULTI / "h200x2-bench-tp2-qwen3-2026-11-30.json"  # the bench-tp2 run inside SERVED's run
FIRST = MULTI / "h200x2-bench-tp2-qwen3-2026-11-30-first.json"  # before one host thread per rank
BEFORE_LOOKAHEAD = MULTI / "h200x2-served-qwen3-2026-11-30-before-lookahead.json"

served, bench = served_checks.recording_fixtures(SERVED, BENCH)


def test_recording_is_two_h200s_serving_the_qwen3_8b_shape(served, bench):
    served_checks.two_h200s_on_the_qwen3_8b_shape(served, bench)
    assert bench["race"]["race_trusted"]
    assert served["checkpoint"]["bytes"] > 16e9


def test_served_ms_per_token_follows_from_the_timed_requests(served):
    s = served["served"]
    ms = (statistics.median(s["long_s"]) - statistics.median(s["short_s"])) * 1e3 / (served["long"] - served["short"])
    assert s["ms_per_token"] == pytest.approx(ms, abs=1e-3)
    assert s["long_completion_tokens"] == served["long"]


def test_the_service_decodes_within_10_percent_of_the_bench_step(served, bench):
    r = served["ratios"]
    assert served["health"]["allreduce"] == r["allreduce"] == "device_mailbox_graph"
    step = bench["tp2"]["device_mailbox_graph"]["decode_graph"]["1024"]["ms"]
    assert r["bench_tp2_step_ms"] == step
    assert r["served_vs_bench"] == pytest.approx(step / served["served"]["ms_per_token"], abs=1e-4)
    assert r["served_vs_bench"] >= 0.90  # the served target (90 % of the bench): 3.81 ms served vs 3.68 ms bench
    assert served["served"]["ms_per_token"] < 40.8 / 10  # the 40.8 ms per token, ten times over


def test_the_ranks_said_how_they_decode(served):
    for r in (0, 1):
        lines = [ln for ln in served["rank_log"] if ln.startswith(f"[rank {r}] decode ")]
        assert lines and "decode graphs (CUDA graphs per context bucket, allreduce device_mailbox_graph " \
                         "captured inside); kernels compiled" in lines[-1]
        assert "windows [256, 512, 1024]" in lines[-1]


def test_one_sse_event_per_token_at_the_step_rate(served):
    st = served["stream"]
    arrivals = st["arrivals_ms"]
    assert st["events"] == len(arrivals) >= served["long"]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    token_gaps = gaps[: served["long"] - 1]
    assert statistics.median(token_gaps) == pytest.approx(st["gap_ms_median"], abs=0.05)
    # every token its own event, about one decode step apart: no bunching, no stall
    assert st["gap_ms_median"] == pytest.approx(served["served"]["ms_per_token"], rel=0.15)
    assert max(token_gaps) < 2 * st["gap_ms_median"]
    assert sum(1 for g in token_gaps if g < 0.5) <= 2


def test_the_race_picked_the_fastest_captured_path(bench, served):
    race = bench["race"]
    assert race["picked"] == "device_mailbox_graph"
    assert all(v == "passed" for v in race["selftest"].values())
    modes = {k: v["mode"] for k, v in race["race_us"].items()}
    assert modes == {"device_mailbox_graph": "graph", "nccl": "graph", "device_mailbox": "eager",
                     "host_mailbox": "eager", "gloo": "eager"}
    best = min(race["race_us"], key=lambda k: race["race_us"][k]["8k_us"] + race["race_us"][k]["40k_us"])
    assert best == race["picked"] and race["judged"]["8k"]["picked_is_fastest"] and race["judged"]["40k"]["picked_is_fastest"]
    ar = bench["allreduce"]["device_mailbox_graph"]
    assert all(ar["bit_exact"].values()) and ar["graph_us"]["8k"] < 4.0 < ar["eager_us"]["8k"]


def test_summary_ratios_recompute_and_the_open_targets_stay_open(bench):
    from engine.bench.tp2 import summary

    assert summary(bench, "1024") == bench["summary"]
    s = bench["summary"]
    tp1 = s["tp1"]
    w = bench["tp1"]["rank0"]["weight_bytes"]
    assert tp1["floor_ms"] == pytest.approx(w / (bench["read_bw_gbps"][0] * 1e9) * 1e3, abs=1e-3)
    assert tp1["read_bw_fraction"] == pytest.approx(tp1["floor_ms"] / tp1["step_ms"], abs=1e-4)
    gm = s["device_mailbox_graph"]
    assert gm["tp2_vs_tp1_bench"] == pytest.approx(tp1["step_ms"] / gm["step_ms"], abs=1e-4)
    assert gm["step_ms"] < s["nccl"]["step_ms"]  # the captured mailbox beats captured NCCL in the step too
    # Recorded as missed (docs/engine-speed.md says why): TP2 1.42x TP1 (target 1.6x), TP1 67 % of read
    # bandwidth (target 80 %).
    assert 1.3 < gm["tp2_vs_tp1_bench"] < 1.6
    assert 0.6 < tp1["read_bw_fraction"] < 0.8


def test_the_served_loop_spends_its_host_time_while_the_gpu_works(bench):
    dec = bench["tp2"]["device_mailbox_graph"]["served"]["decoder"]
    assert dec["mode"] == "graphs" and dec["host_threads"] == 1
    # The hook (lockstep exchange, hand-out) waits behind the next step already running: its time is the
    # step's; sampling and launching are tens of microseconds.
    assert dec["host_ms"]["sample"] < 0.1 and dec["host_ms"]["launch"] < 0.05
    assert dec["token_ms"] == pytest.approx(dec["step_ms"], rel=0.10)


def test_earlier_runs_of_the_day_show_what_each_fix_bought(bench):
    first = json.loads(FIRST.read_text())["tp2"]["device_mailbox_graph"]["served"]["decoder"]
    # all CPU threads per rank, host argmax, no lookahead: 17 ms per token around a 3.8 ms step
    assert first["token_ms"] > 4 * first["step_ms"] and "host_ms" not in first
    before = json.loads(BEFORE_LOOKAHEAD.read_text())
    assert before["health"]["allreduce"] == "device_mailbox_graph"
    assert before["served"]["ms_per_token"] > json.loads(SERVED.read_text())["served"]["ms_per_token"] + 0.3
