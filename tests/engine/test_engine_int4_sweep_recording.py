"""Judges the H200 recording of 2026-12-04's int4 GEMV sweep (python -m engine.bench.int4 --skip prefill,fp16
--layouts 32 --configs <22 configurations> --profile, tests/fixtures/engine/h200-int4-2026-12-04-sweep.json) on CPU:
every figure follows from the ones beside it, the engine ships each matrix's winner and a default rule near it, the
new table beats the 2026-12-03 table's configurations in the same run, and the 27B int4 step run with it is faster
than the step of the same morning with the old table, its profile accounting for the GEMV's share of the step."""

from __future__ import annotations

import json

import pytest

from engine import tuning
from engine.bench.int4 import PROLOGUE_OF
from engine.kernels import gemv_int4
from tests.engine.test_engine_int4_tiles_recording import packed_bytes
from tests.paths import FIXTURES

FIX = FIXTURES / "engine"
REC = json.loads((FIX / "h200-int4-2026-12-04-sweep.json").read_text())
MORNING = json.loads((FIX / "h200-int4-2026-12-04-step.json").read_text())  # the same model, the 12-03 table
ROWS = [(s, m, r) for s, v in REC["int4"].items() for m, r in v.items()]
OLD = {  # gemv_int4.BLOCKS of 2026-12-03, per matrix of the 27B shape
    ("27b-tp1", "gate_up"): (64, 128, 4, 4, 2, 1), ("27b-tp1", "down"): (32, 128, 1, 8, 2, 1),
    ("27b-tp1", "q_gate"): (64, 128, 4, 4, 2, 1), ("27b-tp1", "k_or_v"): (32, 128, 1, 16, 2, 1),
    ("27b-tp1", "o_proj"): (32, 128, 1, 8, 2, 1), ("27b-tp2", "gate_up"): (64, 128, 4, 4, 2, 1),
    ("27b-tp2", "down"): (32, 128, 1, 8, 2, 1), ("27b-tp2", "q_gate"): (32, 128, 1, 8, 2, 1),
    ("27b-tp2", "k_or_v"): (32, 128, 1, 16, 2, 1), ("27b-tp2", "o_proj"): (32, 128, 1, 8, 2, 1),
}


def key(cfg) -> str:
    return "x".join(map(str, cfg)) + "-t32"


def test_recorded_on_an_h200_with_every_configuration_on_every_matrix():
    assert REC["device"] == "NVIDIA H200" and REC["group_size"] == 128 and REC["dtype"] == "bfloat16"
    assert 4000 < REC["read_bw_gbps"] < 4800 and len(ROWS) == 10
    for _, _, row in ROWS:
        assert len(row["configs"]) == 22 and all("us" in c for c in row["configs"].values())


@pytest.mark.parametrize("shape_set,matrix,row", ROWS, ids=[f"{s}:{m}" for s, m, _ in ROWS])
def test_figures_follow_and_the_engine_ships_the_winner_and_a_default_near_it(shape_set, matrix, row):
    assert row["bytes"] == packed_bytes(row["n"], row["k"], REC["group_size"])
    for c in row["configs"].values():
        assert c["rel_err"] < 1e-2
        gbps = row["bytes"] / (c["us"] * 1e-6) / 1e9
        assert c["gbps"] == pytest.approx(gbps, abs=0.15)
        assert c["fraction"] == pytest.approx(gbps / REC["read_bw_gbps"], abs=1e-4)
    best = row["best"]
    assert best["us"] == min(c["us"] for c in row["configs"].values())
    n, k = row["n"], row["k"]
    assert tuning.load((9, 0)).int4[(PROLOGUE_OF[matrix], n, k)] == tuple(best["blocks"])
    assert row["configs"][key(gemv_int4._default_blocks(n, k))]["us"] <= 1.06 * best["us"]
    old = row["configs"][key(OLD[(shape_set, matrix)])]["us"]
    assert best["us"] <= old
    if matrix in ("down", "o_proj", "k_or_v"):  # where the one-warp programs ran: 8-12 % faster
        assert best["us"] < 0.93 * old, (best["us"], old)


def test_the_summary_is_recomputed_and_the_target_is_not_claimed():
    s = REC["int4_summary"]
    b = sum(r["bytes"] for _, _, r in ROWS)
    t = sum(r["best"]["us"] for _, _, r in ROWS)
    assert s["bytes_weighted_fraction"] == pytest.approx(b / (t * 1e-6) / 1e9 / REC["read_bw_gbps"], abs=1e-4)
    tiles = json.loads((FIX / "h200-int4-2026-12-03-tiles.json").read_text())["int4_summary"]
    assert s["bytes_weighted_fraction"] > tiles["by_layout"]["t32"]["bytes_weighted_fraction"] + 0.02  # 43.9 -> 47.2 %
    assert s["bytes_weighted_fraction"] < s["target_fraction"] == 0.75


@pytest.mark.parametrize("ctx", ["1024", "131072"])
def test_the_step_with_the_new_table_is_faster_and_its_profile_adds_up(ctx):
    step, c = REC["step"], REC["step"]["contexts"][ctx]
    assert step["packed_bytes"] == MORNING["step"]["packed_bytes"]
    floor = (step["weight_bytes"] + c["kv_bytes"] + c["state_bytes"]) / (REC["read_bw_gbps"] * 1e9) * 1e3
    assert c["floor_ms"] == pytest.approx(floor, rel=2e-3) and c["of_floor"] == pytest.approx(floor / c["ms"], abs=1e-3)
    assert c["ms"] < 0.97 * MORNING["step"]["contexts"][ctx]["ms"]  # 7.17 -> 6.85 ms at 1K, 9.31 -> 9.01 at 128K
    p = c["profile"]
    by = {t["kernel"]: t for t in p["top"]}
    gemv, row = by["int4_gemv_kernel"], by["int4_row_kernel"]
    # 64 layers x 4 packed products (MLP gate/up and down, the attention's or the Gated DeltaNet's in and out)
    assert gemv["launches"] == row["launches"] == 256
    assert sum(t["us"] for t in p["top"]) <= p["busy_us"] + 0.5
    assert 0.9 < (p["busy_us"] + p["idle_us"]) / 1e3 / c["ms"] < 1.1  # the profile accounts for the step
    # the GEMVs alone in the step: the packed bytes over their time, ~59 % of read bandwidth
    frac = step["packed_bytes"] / (gemv["us"] * 1e-6) / (REC["read_bw_gbps"] * 1e9)
    assert 0.5 < frac < 0.75
