"""The two-H200 recordings of 2026-11-30 after lockstep moved inside the graph and the Triton GEMV became
the default kernel, judged on CPU: the service against the bench's step (`python -m engine.bench.served`,
one run), the lockstep / fault transcript of tests/engine/test_engine_lockstep_gpu.py, and the stalled-rank run.
Every ratio is recomputed from the figures beside it; met and missed targets are asserted as recorded."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.conftest import FIXTURES

MULTI = FIXTURES / "multigpu"
SERVED = json.loads((MULTI / "h200x2-served-qwen3-gemv-2026-11-30.json").read_text())
BENCH = json.loads((MULTI / "h200x2-bench-tp2-qwen3-gemv-2026-11-30.json").read_text())
BEFORE = json.loads((MULTI / "h200x2-served-qwen3-2026-11-30.json").read_text())  # cuBLAS, eager lockstep
LOCKSTEP = json.loads((MULTI / "h200x2-lockstep-in-graph-2026-11-30.json").read_text())
STALL = json.loads((MULTI / "h200x2-stall-in-graph-2026-11-30.json").read_text())


def test_two_h200s_and_the_kernels_and_lockstep_the_ranks_said_they_use():
    assert [c["device"] for c in BENCH["cards"]] == ["NVIDIA H200", "NVIDIA H200"]
    assert BENCH["cards"][0]["uuid"] != BENCH["cards"][1]["uuid"] and BENCH["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert SERVED["bench_summary"] == BENCH["summary"] and SERVED["config"] == "qwen3-8b.config.json"
    log = SERVED["rank_log"]  # the tail of rank 1's log
    line = [ln for ln in log if ln.startswith("[rank 1] decode graphs (")][-1]
    assert "kernels gemv" in line and "lockstep in the step's graph" in line
    assert "read bandwidth" in line and "(measured)" in line
    # after every request, the rank logs what its step achieved
    stats = [ln for ln in log if ln.startswith("[rank 1] decode graphs/gemv: step ")]
    assert len(stats) >= 7 and all(" GB/s (measured), over " in ln for ln in stats)


def test_served_tp2_is_within_10_percent_of_the_bench_step_and_faster_than_before():
    s, r = SERVED["served"], SERVED["ratios"]
    ms = (statistics.median(s["long_s"]) - statistics.median(s["short_s"])) * 1e3 / (SERVED["long"] - SERVED["short"])
    assert s["ms_per_token"] == pytest.approx(ms, abs=1e-3)
    step = BENCH["tp2"]["device_mailbox_graph"]["decode_graph"]["1024"]["ms"]
    assert r["bench_tp2_step_ms"] == step
    assert r["served_vs_bench"] == pytest.approx(step / s["ms_per_token"], abs=1e-4) and r["served_vs_bench"] >= 0.90
    # the same shape, the same kind of machine, earlier that day with cuBLAS products: both got faster
    assert step < BEFORE["ratios"]["bench_tp2_step_ms"] - 0.4
    assert s["ms_per_token"] < BEFORE["served"]["ms_per_token"] - 0.3


def test_tp1_and_tp2_against_their_targets_as_recorded():
    from engine.bench.tp2 import summary

    assert summary(BENCH, "1024") == BENCH["summary"]
    s = BENCH["summary"]
    tp1, gm = s["tp1"], s["device_mailbox_graph"]
    assert tp1["kernels"] == "gemv"
    w = BENCH["tp1"]["rank0"]["weight_bytes"]
    assert tp1["floor_ms"] == pytest.approx(w / (BENCH["read_bw_gbps"][0] * 1e9) * 1e3, abs=1e-3)
    assert tp1["read_bw_fraction"] == pytest.approx(tp1["floor_ms"] / tp1["step_ms"], abs=1e-4)
    assert gm["tp2_vs_tp1_bench"] == pytest.approx(tp1["step_ms"] / gm["step_ms"], abs=1e-4)
    # Missed, narrowly for TP1 (docs/engine-speed.md): 79.0 % of read bandwidth (target 80 %),
    # TP2 1.47x TP1 (target 1.6x); both up from 67 % and 1.42x with cuBLAS products.
    assert 0.75 < tp1["read_bw_fraction"] < 0.80 and 1.42 < gm["tp2_vs_tp1_bench"] < 1.6
    assert s["race_picked"] == "device_mailbox_graph" and all(s["race_picked_is_fastest"].values())


def test_with_lockstep_in_the_graph_the_hook_no_longer_waits_for_the_next_step():
    dec = BENCH["tp2"]["device_mailbox_graph"]["served"]["decoder"]
    assert dec["lockstep"].startswith("in the step's graph")
    # the host waits for the step once, in the read-back of token + agree flag ("sample"); the hook only
    # hands the token out (it used to queue an exchange behind the next step and wait for it)
    assert dec["host_ms"]["hook"] < 0.25 and dec["host_ms"]["sample"] > 0.8 * dec["step_ms"]
    assert dec["token_ms"] == pytest.approx(dec["step_ms"], rel=0.10)


def test_sse_one_event_per_token_at_the_step_rate():
    st = SERVED["stream"]
    gaps = [b - a for a, b in zip(st["arrivals_ms"], st["arrivals_ms"][1:])][: SERVED["long"] - 1]
    assert st["events"] >= SERVED["long"] and statistics.median(gaps) == pytest.approx(st["gap_ms_median"], abs=0.05)
    assert st["gap_ms_median"] == pytest.approx(SERVED["served"]["ms_per_token"], rel=0.15)


def test_the_service_reported_its_own_decode_figures():
    lines = [ln for ln in SERVED["metrics"] if ln.startswith("v100plan_decode_")]
    got = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines}
    assert got['v100plan_decode_mode{kernels="gemv",mode="graphs",rank="0"}'] == 1
    for r in ("0", "1"):
        step = got[f'v100plan_decode_step_ms{{rank="{r}"}}']
        assert step == pytest.approx(SERVED["ratios"]["bench_tp2_step_ms"], rel=0.05)
        gbps = got[f'v100plan_decode_achieved_gbps{{rank="{r}"}}']
        w = BENCH["tp2"]["device_mailbox_graph"]["served"]["decoder"]["weight_bytes"]  # one rank's half
        assert gbps == pytest.approx(w / step / 1e6,
                                     rel=0.01)
        bw = [v for k, v in got.items() if k.startswith(f'v100plan_decode_read_bw_gbps{{rank="{r}",source="measured"')]
        assert bw and got[f'v100plan_decode_read_bw_fraction{{rank="{r}"}}'] == pytest.approx(gbps / bw[0], abs=2e-4)


def test_faults_were_caught_inside_the_graph_on_two_gpus():
    assert LOCKSTEP["passed"] is True
    assert LOCKSTEP["equal_to_tp1"] == ["The quick brown fox", "Once upon a time"]
    d = LOCKSTEP["health"]["decode"]
    assert {d[r]["mode"] for r in d} == {"graphs"} and {d[r]["lockstep"][:18] for r in d} == {"in the step's grap"}
    reason = LOCKSTEP["corrupt_hash"]["failure"]["reason"]
    assert "LOCKSTEP FAILURE at step" in reason and "checked inside the decode step's graph" in reason
    h0, h1 = (int(x) for x in reason.rsplit("hash ", 1)[1].split(" != "))
    assert h0 ^ h1 == 1  # exactly the injected bit, found in the step it was injected in
    assert LOCKSTEP["corrupt_hash"]["failure"]["cause"] == "lockstep"
    # before the GPU-side waits gave up together, the stall was found by the proxy's 30 s timeout ...
    assert LOCKSTEP["stall"]["failure"]["cause"] == "stall"
    # ... after: the peer's own captured wait reports it one 4 s deadline after the stall
    assert STALL["failure"]["cause"] == "exit" and STALL["waited_s"] < 6
    assert "allreduce failed: device_mailbox_graph: a wait passed 4.0 s on the GPU" in STALL["failure"]["reason"]
