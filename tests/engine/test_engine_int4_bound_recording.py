"""Judges the H200 recordings of what bounds the int4 GEMV (docs/engine-speed.md, 2026-12-04 afternoon) on CPU:
a persistent grid against the ordinary one in the same run (h200-int4-2026-12-04-persist.json: no gain, so no tail
effect), Nsight Compute's counters of both loop forms (h200-int4-ncu-stalls-2026-12-04.csv: warps stalled on
their loads far more than on anything else, DRAM near half its peak), and two tiles ahead in registers against one
(h200-int4-2026-12-04-ahead2.json: slower on the big matrices, the registers it costs outweighing the loads it adds
in flight; predicted 0-20 % faster). The GPU tests of each passed."""

from __future__ import annotations

import csv
import json

import pytest

from tests.engine_helpers import junit_suite
from tests.paths import FIXTURES

FIX = FIXTURES / "engine"
PERSIST = json.loads((FIX / "h200-int4-2026-12-04-persist.json").read_text())
AHEAD = json.loads((FIX / "h200-int4-2026-12-04-ahead2.json").read_text())
MATRICES = [(s, m) for s, v in PERSIST["int4"].items() for m in v]


def _by(row: dict, field: int) -> dict[int, float]:
    """The fastest timing per value of one blocks field (configuration keys BNxBKxWxSxSTxFORM[xP]-t32)."""
    out: dict[int, float] = {}
    for key, c in row["configs"].items():
        if "us" in c:
            v = int(key.split("-")[0].split("x")[field])
            out[v] = min(out.get(v, float("inf")), c["us"])
    return out


def _ncu() -> dict[int, dict[str, float]]:
    rows = [r for r in csv.reader((FIX / "h200-int4-ncu-stalls-2026-12-04.csv").open()) if len(r) > 10]
    head = rows[0]
    ii, im, iv, ik = head.index("ID"), head.index("Metric Name"), head.index("Metric Value"), head.index("Kernel Name")
    out: dict[int, dict[str, float]] = {}
    for r in rows[1:]:
        assert r[ik] == "int4_gemv_kernel"
        out.setdefault(int(r[ii]), {})[r[im]] = float(r[iv].replace(",", ""))
    return out


def test_the_runs_are_of_the_27b_matrices_on_an_h200():
    for d in (PERSIST, AHEAD):
        assert d["device"] == "NVIDIA H200" and d["triton"] == "3.6.0" and len(d["int4"]["27b-tp1"]) == 5
    assert len(MATRICES) == 10


@pytest.mark.parametrize("shape_set,matrix", MATRICES)
def test_a_persistent_grid_is_no_faster_than_the_ordinary_one(shape_set, matrix):
    by = _by(PERSIST["int4"][shape_set][matrix], 6)
    assert set(by) == {0, 4, 8, 12, 16}
    assert min(by[p] for p in (8, 12, 16)) > 0.99 * by[0]  # within 1 % at best: no tail to take off
    assert by[4] >= 0.99 * by[0]  # half the programs an SM can hold: as slow or slower


def test_both_forms_wait_on_their_loads_and_dram_runs_near_half_its_peak():
    m = _ncu()
    assert sorted(m) == list(range(12))  # 4 configurations x 3 calls
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    for i in (1, 4, 7, 10):  # the second call of each: pairs gate/up, subnormal gate/up, pairs down, subnormal down
        k = m[i]
        others = [v for name, v in k.items() if "stalled" in name and "long_scoreboard" not in name
                  and "selected" not in name]
        assert k[stall.format("long_scoreboard")] > 2.5 * max(others)  # memory waits dominate every other stall
        assert 40 < k["dram__throughput.avg.pct_of_peak_sustained_elapsed"] < 60
        assert k["dram__bytes_read.sum"] == pytest.approx([92.6e6, 92.6e6, 46.3e6, 46.3e6][(i - 1) // 3], rel=0.01)
    # the subnormal form issues ~40 % fewer instructions with half the warps active, and the same DRAM rate
    assert m[4]["smsp__inst_executed.sum"] < 0.7 * m[1]["smsp__inst_executed.sum"]
    assert m[4]["launch__registers_per_thread"] == 128 and m[1]["launch__registers_per_thread"] == 64
    assert m[4]["sm__warps_active.avg.pct_of_peak_sustained_active"] < 0.6 * m[1][
        "sm__warps_active.avg.pct_of_peak_sustained_active"]


@pytest.mark.parametrize("matrix", ["gate_up", "down", "q_gate", "o_proj"])
@pytest.mark.parametrize("shape_set", ["27b-tp1", "27b-tp2"])
def test_two_tiles_ahead_is_slower_on_the_big_matrices(shape_set, matrix):
    by = _by(AHEAD["int4"][shape_set][matrix], 4)
    assert set(by) == {1, 2, 5}
    assert by[5] > 1.04 * min(by[1], by[2])  # 96 registers: 5 programs an SM instead of 8


def test_two_tiles_ahead_helps_only_the_smallest_matrix_and_the_step_is_unchanged():
    small = _by(AHEAD["int4"]["27b-tp2"]["k_or_v"], 4)
    assert small[5] < small[2]  # 4.72 against 4.89 us: 512 rows, 32 slices, the only winner
    assert AHEAD["step"]["contexts"]["1024"]["ms"] == pytest.approx(PERSIST["step"]["contexts"]["1024"]["ms"], rel=0.01)


@pytest.mark.parametrize("name,count", [("persist", 24), ("ahead2", 25)])
def test_the_gpu_tests_of_each_passed(name, count):
    suite = junit_suite(FIX / f"h200-gpu-tests-{name}-2026-12-04.xml")
    assert (int(suite.get("tests")), int(suite.get("failures")), int(suite.get("errors")),
            int(suite.get("skipped"))) == (count, 0, 0, 0)
    names = [c.get("name") for c in suite.findall("testcase")]
    assert any(n.startswith("test_a_persistent_grid_gives_the_ordinary_grids_answer") for n in names)
    if name == "ahead2":
        assert "test_two_tiles_ahead_gives_the_one_tile_ahead_answer_on_the_gpu" in names
