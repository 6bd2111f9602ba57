"""The hybrid engine's bench on one H200 (docs/h200_hybrid_run.sh, 2026-12-01), judged by what it measured: the
27B hybrid shape's decode step against the floor its own bytes and read bandwidth give, and prefill against the
dense bf16 peak. Each ratio is recomputed from the recorded bytes and times, not read back."""

from __future__ import annotations

import json

import pytest

from engine.core import config as ecfg
from engine.kernels import decode
from tests.conftest import FIXTURES, REPO

BENCH = FIXTURES / "engine" / "h200-hybrid-27b-bench-2026-12-01.json"


@pytest.fixture(scope="module")
def bench():
    return json.loads(BENCH.read_text())


def test_it_is_the_27b_hybrid_shape_on_an_h200_with_the_service_kernels(bench):
    cfg = ecfg.load_file(REPO / "engine" / "data" / bench["config"])
    assert bench["device"] == "NVIDIA H200" and bench["dtype"] == "bfloat16"
    assert bench["parameters"] == cfg.param_count() and cfg.n_linear == 48 and cfg.n_full == 16
    assert bench["kv_bytes_per_token"] == cfg.kv_bytes_per_token(2)
    assert bench["decode_kernels"] == "fused"
    # weights: every matrix in bf16 once (embedding: one row), what the engine's layer table holds
    assert abs(bench["weight_bytes"] - 2 * (cfg.param_count() - cfg.vocab_size * cfg.hidden_size)) < 1e8
    assert 4000 < bench["read_bw_gbps"] < 4900


def test_decode_step_against_its_floor_at_1k_and_128k(bench):
    bw = bench["read_bw_gbps"] * 1e9
    rows = bench["decode"]["service_graph"]
    frac = {}
    for ctx, r in rows.items():
        assert r["kv_bytes"] == bench["kv_bytes_per_token"] * int(ctx)
        floor_ms = (bench["weight_bytes"] + r["kv_bytes"] + r["state_bytes"]) / bw * 1e3
        frac[int(ctx)] = floor_ms / r["ms"]
    assert frac[1024] >= 0.80 and frac[131072] >= 0.75  # the targets
    assert all(frac[a] >= frac[b] for a, b in zip(sorted(frac), sorted(frac)[1:]))  # K/V costs more as it grows
    # the step grows by about the K/V bytes over the attention's K/V rate
    slope = (rows["262144"]["ms"] - rows["1024"]["ms"]) / (rows["262144"]["kv_bytes"] - rows["1024"]["kv_bytes"])
    assert 0.4 < 1 / (slope * 1e-3) / bw < 0.9


def test_prefill_rates_follow_from_the_recorded_times(bench):
    for n, r in bench["prefill"].items():
        assert r["tokens"] == int(n)
        assert r["tok_s"] == pytest.approx(int(n) / (r["ms"] / 1e3), rel=1e-3)
        assert r["compute_fraction"] == pytest.approx(r["tflops"] / bench["peak_tflops"], abs=1e-3)


FINAL = FIXTURES / "engine" / "h200-hybrid-27b-bench-2026-12-01-final.json"
INT8 = FIXTURES / "engine" / "h200-hybrid-27b-int8-bench-2026-12-01-final.json"
TTFT = FIXTURES / "engine" / "h200-prefix-ttft-2026-12-01.json"
TTFT_2 = FIXTURES / "engine" / "h200-prefix-ttft-2026-12-02.json"  # with the one-pass snapshot keys
TTFT_3 = FIXTURES / "engine" / "h200-prefix-ttft-2026-12-02-evening.json"  # GDN prefill kernels unspecialised
ATTN = {shape: FIXTURES / "engine" / f"h200-attention-2026-12-02-{shape}.json" for shape in ("27b", "8b")}


def _fractions(doc):
    bw = doc["read_bw_gbps"] * 1e9
    return {int(c): (doc["weight_bytes"] + r["kv_bytes"] + r["state_bytes"]) / bw * 1e3 / r["ms"]
            for c, r in doc["decode"]["service_graph"].items()}


def test_the_merged_engine_keeps_the_targets_and_the_int8_cache_holds_half_the_bytes():
    final, int8 = json.loads(FINAL.read_text()), json.loads(INT8.read_text())
    f = _fractions(final)
    assert f[1024] >= 0.80 and f[131072] >= 0.75
    assert int8["kv_cache_dtype"] == "int8"
    # int8: one byte a value plus a float32 scale per position and kv head (16 layers x 4 heads x 2)
    assert int8["kv_bytes_per_token"] == final["kv_bytes_per_token"] // 2 + 16 * 4 * 2 * 4
    # what the int8 cache measured: it reads half the bytes but its step is not faster (docs/engine-speed.md)
    ms = {k: {c: r["ms"] for c, r in d["decode"]["service_graph"].items()} for k, d in (("bf16", final), ("int8", int8))}
    assert ms["int8"]["262144"] > ms["bf16"]["262144"] * 0.9


def test_prefix_reuse_through_the_service_measured_on_an_h200():
    doc = json.loads(TTFT.read_text())
    assert "error" not in doc and doc["conversation"] == 100_000 and doc["new"] == 200
    assert doc["health"]["allreduce"] and doc["health"]["state"] == "up"
    # the follow-up turn reuses the conversation: a small fraction of the cold prefill
    assert doc["follow_up_ttft_s"] <= 1.5 and doc["follow_up_ttft_s"] < doc["cold_ttft_s"] / 20
    assert doc["repeat_ttft_s"] < doc["follow_up_ttft_s"]


def test_a_repeated_prompt_answers_within_0_2_s_once_its_snapshot_keys_take_one_pass():
    # the same bench the next day (fresh machine, the code with engine.core.prefix._keys): the repeated
    # 100K-token prompt restores a snapshot after checking a dozen keys; before, that check hashed each prefix
    # from its start as text (0.259 s in the run above)
    before, doc = json.loads(TTFT.read_text()), json.loads(TTFT_2.read_text())
    assert "error" not in doc and (doc["conversation"], doc["new"], doc["layers"]) == (100_000, 200, 16)
    assert doc["repeat_ttft_s"] <= 0.2 < before["repeat_ttft_s"]
    assert doc["repeat_ttft_s"] < doc["follow_up_ttft_s"] < doc["cold_ttft_s"] / 5
    # not held here: this run's follow-up took 1.84 s (0.396 s before; docs/engine-speed.md names it open)


def test_a_follow_up_of_a_length_not_seen_before_compiles_nothing_and_answers_within_1_5_s():
    # the same bench after the Gated DeltaNet prefill kernels stopped specialising on the chunk's length: the
    # follow-up (1.84 s in TTFT_2) and a second follow-up of another length answer in a fraction of a second
    before, doc = json.loads(TTFT_2.read_text()), json.loads(TTFT_3.read_text())
    assert "error" not in doc and (doc["conversation"], doc["new"], doc["layers"]) == (100_000, 200, 16)
    assert doc["follow_up_ttft_s"] <= 1.5 and doc["follow_up_ttft_s"] < before["follow_up_ttft_s"] / 3
    assert doc["follow_up_2_ttft_s"] <= 1.5 and doc["repeat_ttft_s"] <= 0.2
    assert max(doc["follow_up_ttft_s"], doc["follow_up_2_ttft_s"]) < doc["cold_ttft_s"] / 20
    log = (FIXTURES / "engine" / "h200-gdn-compile-once-2026-12-02.txt").read_text()
    counts = json.loads(log.split("compiled variants after each length: ")[1].splitlines()[0].replace("(", "[")
                        .replace(")", "]"))
    assert len(counts) == 6 and all(c == counts[0] for c in counts) and "1 passed" in log


def _attention_rows(shape):
    doc = json.loads(ATTN[shape].read_text())
    return doc, [r for r in doc["rows"] if "us" in r]


@pytest.mark.parametrize("shape", ["27b", "8b"])
def test_the_long_window_attention_configuration_is_the_fastest_measured_and_its_fraction(shape):
    doc, rows = _attention_rows(shape)
    hd = 256 if shape == "27b" else 128
    bs, warps, stages = decode.LONG_CONFIG[hd]
    for ctx in (131072, 262144):
        at = [r for r in rows if r["context"] == ctx]
        best = min(at, key=lambda r: r["us"])
        chosen = [r for r in at if (r["block_s"], r["warps"], r["stages"], r["programs"], r["prefetch"]) ==
                  (bs, warps, stages, decode.TARGET_PROGRAMS, False)]
        assert len(chosen) == 1 and chosen[0]["us"] == best["us"]  # the engine runs the fastest of the sweep
        assert chosen[0]["err"] < 1e-2
        kv_bytes = 2 * {"27b": 4, "8b": 8}[shape] * ctx * hd * 2
        frac = kv_bytes / (best["us"] * 1e-6) / (doc["read_bw_gbps"] * 1e9)
        assert abs(frac - best["of_read"]) < 2e-3  # the fraction is the bytes over the time measured
        old = [r for r in at if (r["block_s"], r["stages"], r["prefetch"]) == (
            (decode.HD256_CONFIG[0], 1, False) if hd == 256 else (decode.BLOCK_S, 1, False))
            and r["warps"] == (decode.HD256_CONFIG[1] if hd == 256 else decode.NUM_WARPS)
            and r["programs"] == decode.TARGET_PROGRAMS]
        # at least 10 % faster than the configuration before (the 8B sweep was cut by its time limit before it
        # reached that configuration at 256K)
        assert old or (shape, ctx) == ("8b", 262144)
        assert all(best["us"] < 0.9 * r["us"] for r in old)
    # what the targets say (docs/engine-speed.md): >= 80 % of read bandwidth at 128K and 256K; the 27B shape's
    # 128K is short of it (74 %), the rest reach it
    fr = {r["context"]: r["of_read"] for r in rows if (r["block_s"], r["warps"], r["stages"]) == (bs, warps, stages)
          and r["programs"] == decode.TARGET_PROGRAMS and not r["prefetch"]}
    assert fr[262144] >= 0.80
    assert (fr[131072] >= 0.80) == (shape == "8b")
