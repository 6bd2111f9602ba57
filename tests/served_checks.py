"""Checks shared by the recordings of `python -m engine.bench.served` on two H200s
(tests/engine/test_engine_served_*_recording.py): each recomputes a ratio from the figures beside it and returns it."""

from __future__ import annotations

import json
import statistics

import pytest


def recording_fixtures(served_path, bench_path):
    """Module-scoped fixtures ``served`` and ``bench`` loading a served-bench run and the bench-tp2 run inside it."""
    @pytest.fixture(scope="module")
    def served():
        return json.loads(served_path.read_text())

    @pytest.fixture(scope="module")
    def bench():
        return json.loads(bench_path.read_text())

    return served, bench


def two_h200s_on_the_qwen3_8b_shape(served: dict, bench: dict) -> None:
    """The recording is the served bench on two distinct H200s, bf16, the Qwen3-8B shape, multicast off, and the
    bench run inside it is the one beside it."""
    assert served["kind"] == "engine_bench_served" and served["devices"] == "cuda:0,cuda:1"
    assert served["bench_summary"] == bench["summary"]
    assert served["dtype"] == bench["dtype"] == "bfloat16" and served["config"] == bench["config"] == "qwen3-8b.config.json"
    assert [c["device"] for c in bench["cards"]] == ["NVIDIA H200", "NVIDIA H200"]
    assert bench["cards"][0]["uuid"] != bench["cards"][1]["uuid"]
    assert bench["env"]["NCCL_NVLS_ENABLE"] == "0"  # multicast off, as the lent machines require


def both_ranks_fused_graphs_on_the_mailbox(served: dict) -> list[dict]:
    """Both ranks decoded with captured graphs of the fused kernels, exchanging through the GPU-side mailbox;
    their /health decode blocks, rank 0's first."""
    decs = [served["health"]["decode"][r] for r in ("0", "1")]
    for dec in decs:
        assert dec["mode"] == "graphs" and dec["kernels"] == "fused" and dec["allreduce"] == "device_mailbox_graph"
    return decs


def tp1_read_bw_fraction(bench: dict) -> float:
    """The TP1 step against the floor at the read bandwidth measured in the same run."""
    from engine.bench.tp2 import summary

    computed, recorded = summary(bench, "1024"), bench["summary"]
    # every figure the product computes from the run is the one recorded; a recording may also hold the A/B of an
    # exchange mode deleted since (norm-receive, recorded as "gemv"), which the product no longer computes
    for name, row in computed.items():
        rec = recorded[name]
        if isinstance(row, dict):
            assert {k: v for k, v in rec.items() if not k.endswith("_exchange_gemv")} == row, name
        else:
            assert rec == row, name
    tp1 = computed["tp1"]
    w = bench["tp1"]["rank0"]["weight_bytes"]
    assert tp1["floor_ms"] == pytest.approx(w / (bench["read_bw_gbps"][0] * 1e9) * 1e3, abs=1e-3)
    assert tp1["read_bw_fraction"] == pytest.approx(tp1["floor_ms"] / tp1["step_ms"], abs=1e-4)
    return tp1["read_bw_fraction"]


def served_vs_bench(served: dict, bench: dict) -> float:
    """Served ms/token from the short and long requests' medians, against the bench's TP2 graph step."""
    s = served["served"]
    ms = (statistics.median(s["long_s"]) - statistics.median(s["short_s"])) * 1e3 / (served["long"] - served["short"])
    assert s["ms_per_token"] == pytest.approx(ms, abs=1e-3)
    r = served["ratios"]
    step = bench["summary"]["device_mailbox_graph"]["step_ms"]
    assert r["bench_tp2_step_ms"] == step
    assert r["served_vs_bench"] == pytest.approx(step / s["ms_per_token"], abs=1e-3)
    return r["served_vs_bench"]


def race_picked_fastest(bench: dict) -> str:
    """The start-up race's pick is the path with the least 8 KB + 40 KB time, captured in a graph."""
    race = bench["race"]
    assert all(v == "passed" for v in race["selftest"].values())
    best = min(race["race_us"], key=lambda k: race["race_us"][k]["8k_us"] + race["race_us"][k]["40k_us"])
    assert best == race["picked"] and race["race_us"][best]["mode"] == "graph"
    assert race["judged"]["8k"]["picked_is_fastest"] and race["judged"]["40k"]["picked_is_fastest"]
    return race["picked"]


def sse_one_event_per_token(served: dict, skip_first: int = 0) -> None:
    """One SSE event per generated token, at the served step rate, no gap over twice the median."""
    st = served["stream"]
    arrivals = st["arrivals_ms"]
    assert st["events"] == len(arrivals) >= served["long"]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])][skip_first: served["long"] - 1]
    assert statistics.median(gaps) == pytest.approx(st["gap_ms_median"], abs=0.05)
    assert st["gap_ms_median"] == pytest.approx(served["served"]["ms_per_token"], rel=0.15)
    assert max(gaps) < 2 * st["gap_ms_median"]
