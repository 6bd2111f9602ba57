"""Judges the H200 recording of the int4 GEMV with its words held in rows and in tiles (python -m engine.bench.int4
--layouts 0,32,64, tests/fixtures/engine/h200-int4-2026-12-03-tiles.json) on CPU: every figure is recomputed from
the ones beside it, each layout's best is the fastest of that layout's timings, the engine holds the tiled layout it
measured (TILE_ROWS; its table of blocks is now the 2026-12-04 sweep's), the tiles are faster
than the rows on every matrix of the same run, and the 27B int4 decode step (run with those tiles and that table)
is faster than the 2026-12-02 step, with the 75 % GEMV target still not claimed."""

from __future__ import annotations

import json

import pytest

from engine import tuning
from engine.kernels import gemv_int4
from tests.paths import FIXTURES

FIX = FIXTURES / "engine"
REC = json.loads((FIX / "h200-int4-2026-12-03-tiles.json").read_text())
PAIRS = json.loads((FIX / "h200-int4-2026-12-02-pairs.json").read_text())  # the row layout, the day before
ROWS = [(s, m, r) for s, v in REC["int4"].items() for m, r in v.items()]
LAYOUTS = {"rows": "", "t32": "-t32", "t64": "-t64"}  # best_by_layout's names -> the suffix of its timings' keys


def packed_bytes(n: int, k: int, group: int) -> int:
    g = k // group
    return n * k // 2 + g * n // 2 + g * n * 2  # 4-bit weights, 4-bit zero points, fp16 scales


def layout_of(key: str) -> str:
    tail = key.rsplit("-", 1)[1] if "-" in key else ""
    return {"": "rows", "t32": "t32", "t64": "t64"}[tail]


def test_recorded_on_an_h200_with_three_layouts_of_every_matrix():
    assert REC["device"] == "NVIDIA H200" and REC["group_size"] == 128 and REC["dtype"] == "bfloat16"
    assert 4000 < REC["read_bw_gbps"] < 4800
    assert len(ROWS) == 10
    for _, _, row in ROWS:
        assert set(row["best_by_layout"]) == set(LAYOUTS)
        assert {layout_of(k) for k in row["configs"]} == set(LAYOUTS)


@pytest.mark.parametrize("shape_set,matrix,row", ROWS, ids=[f"{s}:{m}" for s, m, _ in ROWS])
def test_every_timing_is_correct_and_its_figures_and_bests_follow_from_it(shape_set, matrix, row):
    assert row["bytes"] == packed_bytes(row["n"], row["k"], REC["group_size"])
    timed = {key: c for key, c in row["configs"].items() if "us" in c}
    for c in timed.values():
        assert c["rel_err"] < 1e-2  # checked against dequantise-then-matmul before it was timed
        gbps = row["bytes"] / (c["us"] * 1e-6) / 1e9
        assert c["gbps"] == pytest.approx(gbps, abs=0.15)
        assert c["fraction"] == pytest.approx(gbps / REC["read_bw_gbps"], abs=1e-4)
        assert c["gbps"] < REC["read_bw_gbps"] * 1.02  # nothing reads faster than the card
    for lay, suffix in LAYOUTS.items():
        mine = {k: c for k, c in timed.items() if layout_of(k) == lay}
        assert len(mine) >= 10, (lay, sorted(mine))
        best = row["best_by_layout"][lay]
        assert best["us"] == min(c["us"] for c in mine.values())
        assert mine["x".join(map(str, best["blocks"])) + suffix]["us"] == best["us"]
    assert row["best"]["us"] == min(c["us"] for c in timed.values())


@pytest.mark.parametrize("shape_set,matrix,row", ROWS, ids=[f"{s}:{m}" for s, m, _ in ROWS])
def test_the_engine_holds_tiles_and_its_table_is_at_least_as_fast_as_this_runs_winner(shape_set, matrix, row):
    # the table the engine ships now comes from the 2026-12-04 sweep (test_engine_int4_sweep_recording.py); where
    # this run timed the same configuration, it was within the run-to-run spread of this run's winner or faster
    assert gemv_int4.TILE_ROWS == 32 and gemv_int4.TILE_DEVICES == ("cuda",)
    n, k, pro = row["n"], row["k"], row["best"]["prologue"]
    best = row["best_by_layout"]["t32"]
    now = row["configs"].get("x".join(map(str, tuning.load((9, 0)).int4[(pro, n, k)])) + "-t32")
    if now is not None:
        assert now["us"] <= 1.06 * best["us"], (now, best)


@pytest.mark.parametrize("shape_set,matrix,row", ROWS, ids=[f"{s}:{m}" for s, m, _ in ROWS])
def test_tiles_are_faster_than_rows_on_every_matrix_of_the_same_run(shape_set, matrix, row):
    rows, t32 = row["best_by_layout"]["rows"]["us"], row["best_by_layout"]["t32"]["us"]
    assert t32 < rows
    if matrix in ("gate_up", "q_gate"):  # the wide norm matrices: 7-20 % faster; the others 1-10 %
        assert t32 < 0.93 * rows
    # the row layout with the day-before's configurations plus the new ones: never slower than that recording by
    # more than the run-to-run spread (1 %), faster where the new configurations (64-row 4-warp tiles, K in 16
    # slices) win
    assert rows < 1.01 * PAIRS["int4"][shape_set][matrix]["best"]["us"]


def test_the_summary_is_recomputed_per_layout_and_the_target_is_not_claimed():
    s = REC["int4_summary"]
    read = REC["read_bw_gbps"]
    for lay in LAYOUTS:
        b = sum(r["bytes"] for _, _, r in ROWS)
        t = sum(r["best_by_layout"][lay]["us"] for _, _, r in ROWS)
        assert s["by_layout"][lay]["matrices"] == 10
        assert s["by_layout"][lay]["bytes_weighted_fraction"] == pytest.approx(b / (t * 1e-6) / 1e9 / read, abs=1e-4)
    by = {lay: s["by_layout"][lay]["bytes_weighted_fraction"] for lay in LAYOUTS}
    assert by["t32"] > 1.1 * by["rows"]  # 39.1 % -> 43.9 %
    assert by["t64"] == pytest.approx(by["t32"], abs=0.01)  # 64-row tiles: within a point of 32-row ones
    assert by["t32"] > PAIRS["int4_summary"]["bytes_weighted_fraction"]
    assert s["bytes_weighted_fraction"] < s["target_fraction"] == 0.75  # 44 %: the 75 % target is missed


@pytest.mark.parametrize("ctx", ["1024", "131072"])
def test_the_int4_step_with_tiles_follows_from_its_bytes_and_beats_the_day_before(ctx):
    step = REC["step"]
    c = step["contexts"][ctx]
    assert c["kernels"] == "fused" and c["window"] == int(ctx)
    floor_bytes = step["weight_bytes"] + c["kv_bytes"] + c["state_bytes"]
    assert c["floor_ms"] == pytest.approx(floor_bytes / (REC["read_bw_gbps"] * 1e9) * 1e3, rel=2e-3)
    assert c["of_floor"] == pytest.approx(c["floor_ms"] / c["ms"], abs=1e-3)
    assert c["tok_s"] == pytest.approx(1e3 / c["ms"], rel=1e-3)
    assert step["packed_bytes"] == PAIRS["step"]["packed_bytes"]  # the same packed model
    before = PAIRS["step"]["contexts"][ctx]["ms"]
    assert c["ms"] < 0.9 * before  # 9.12 -> 7.80 ms at 1K, 11.94 -> 10.23 ms at 128K
    assert c["of_floor"] < 0.6  # still well short of the floor
