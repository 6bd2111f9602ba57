"""Judges the H200 recordings of the int4 GEMV's subnormal-pairs form (gemv_int4.FORM_SUBN) against the pairs form
in the same runs (bash docs/h200_subn_run.sh e, twice; tests/fixtures/engine/h200-int4-2026-12-04-subn-{rows,quads}
.json, the steps h200-int4-2026-12-04-step-{table,quads}.json) on CPU. The prediction (docs/engine-speed.md, 2026-12-04
afternoon) was that 42 % fewer SASS instructions a nibble would make every matrix 20-30 % faster; the recordings say
otherwise: on every 27B matrix the subnormal form is slower than the pairs form, by 7-28 % with words in tiles of
64-byte rows and by 3-12 % with the words in quads (which the subnormal form needs: 2.5-17 % faster for it, 2-8 %
slower for the pairs form); the step with quads and each matrix's fastest quads blocks is slower than the engine's
table. The pairs form stays the default; the GPU tests of both forms and of quads passed."""

from __future__ import annotations

import json

import pytest

from tests.engine_helpers import junit_suite
from tests.paths import FIXTURES

FIX = FIXTURES / "engine"
ROWS = json.loads((FIX / "h200-int4-2026-12-04-subn-rows.json").read_text())
QUADS = json.loads((FIX / "h200-int4-2026-12-04-subn-quads.json").read_text())
STEP_TABLE = json.loads((FIX / "h200-int4-2026-12-04-step-table.json").read_text())
STEP_QUADS = json.loads((FIX / "h200-int4-2026-12-04-step-quads.json").read_text())
MATRICES = [(s, m) for s, v in QUADS["int4"].items() for m in v]


def _best(row: dict, form: int, layout: str) -> float:
    """The fastest timing of one loop form on one layout (configuration keys BNxBKxWxSxSTxFORM-LAYOUT)."""
    us = [c["us"] for key, c in row["configs"].items()
          if "us" in c and key.endswith(f"-{layout}") and int(key.split("-")[0].split("x")[5]) == form]
    assert us, (form, layout)
    return min(us)


def test_the_runs_time_both_forms_on_the_same_card_and_every_configuration_is_as_accurate():
    for d in (ROWS, QUADS, STEP_TABLE, STEP_QUADS):
        assert d["device"] == "NVIDIA H200" and d["triton"] == "3.6.0" and d["dtype"] == "bfloat16"
    assert len(MATRICES) == 10
    for doc, layouts in ((ROWS, ("t32",)), (QUADS, ("t32", "q32"))):
        for s, m in MATRICES:
            row = doc["int4"][s][m]
            timed = [k for k, c in row["configs"].items() if "us" in c]
            assert len(timed) == 19 * len(layouts)  # 7 pairs-form and 12 subnormal-form configurations a layout
            assert all(row["configs"][k]["rel_err"] < 2e-3 for k in timed)  # bf16 output rounding, both forms


@pytest.mark.parametrize("shape_set,matrix", MATRICES)
def test_the_subnormal_form_is_slower_than_the_pairs_form_on_every_matrix(shape_set, matrix):
    rows, quads = ROWS["int4"][shape_set][matrix], QUADS["int4"][shape_set][matrix]
    assert 1.05 < _best(rows, 2, "t32") / _best(rows, 1, "t32") < 1.3  # 64-byte rows a thread
    assert 1.02 < _best(quads, 2, "q32") / _best(quads, 1, "t32") < 1.15  # its best layout against the default
    assert rows["best"]["blocks"][5] == quads["best"]["blocks"][5] == 1  # the pairs form wins everywhere


@pytest.mark.parametrize("shape_set,matrix", MATRICES)
def test_quads_are_faster_for_the_subnormal_form_and_slower_for_the_pairs_form(shape_set, matrix):
    row = QUADS["int4"][shape_set][matrix]
    assert _best(row, 2, "q32") < 0.98 * _best(row, 2, "t32")  # 2.5 % (TP2 k/v) to 17 % (TP1 gate/up)
    assert _best(row, 1, "q32") > _best(row, 1, "t32")


def test_the_bytes_weighted_fraction_stays_under_half_of_the_target_gap():
    for d in (ROWS, QUADS):
        s = d["int4_summary"]
        assert s["target_fraction"] == 0.75 and 0.45 < s["bytes_weighted_fraction"] < 0.52
    assert QUADS["int4_summary"]["by_layout"]["q32"]["bytes_weighted_fraction"] < \
        QUADS["int4_summary"]["by_layout"]["t32"]["bytes_weighted_fraction"]


@pytest.mark.parametrize("ctx", ["1024", "131072"])
def test_the_step_with_quads_and_their_fastest_blocks_is_slower_than_the_engines_table(ctx):
    a, b = STEP_QUADS["step"]["contexts"][ctx], STEP_TABLE["step"]["contexts"][ctx]
    assert STEP_QUADS["step"]["packed_bytes"] == STEP_TABLE["step"]["packed_bytes"]
    assert 1.01 < a["ms"] / b["ms"] < 1.06  # 7.07 against 6.82 ms at 1K, 9.24 against 8.99 at 128K
    gemv_a = sum(t["us"] for t in a["profile"]["top"] if t["kernel"].startswith("int4_gemv"))
    gemv_b = sum(t["us"] for t in b["profile"]["top"] if t["kernel"].startswith("int4_gemv"))
    assert gemv_a > gemv_b  # the GEMVs themselves, not the rest of the step


def test_the_gpu_tests_of_both_forms_and_of_quads_passed():
    suite = junit_suite(FIX / "h200-gpu-tests-subn-2026-12-04.xml")
    assert (int(suite.get("tests")), int(suite.get("failures")), int(suite.get("errors")),
            int(suite.get("skipped"))) == (22, 0, 0, 0)
    names = [c.get("name") for c in suite.findall("testcase")]
    assert sum(n.startswith("test_the_subnormal_pairs_assembly") for n in names) == 4
    assert "test_words_held_in_tiles_give_the_row_layouts_outputs_on_the_gpu[dtype1]" in names
    assert "test_the_gemv_launched_during_its_row_kernel_reads_this_calls_input_on_every_replay[2]" in names
