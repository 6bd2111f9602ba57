"""Judges the H200 recording of the int4 GEMV launched during its row kernel (programmatic dependent launch,
gemv_int4.pdl_enabled) against the serial launches in the same run (bash docs/h200_defaults_run.sh d;
tests/fixtures/engine/h200-int4-2026-12-04-{pdl,serial}.json) on CPU: the same configurations on the same matrices,
each faster with PDL by a few tenths of a microsecond, the step's idle time between kernels down by ~70 us and the
step itself within a percent (the prediction of ~0.3 ms was not met: docs/engine-speed.md, 2026-12-04); and the GPU
tests, the PDL replay test among them, passed with it."""

from __future__ import annotations

import json

import pytest

from tests.engine_helpers import junit_suite
from tests.paths import FIXTURES

FIX = FIXTURES / "engine"
PDL = json.loads((FIX / "h200-int4-2026-12-04-pdl.json").read_text())
SERIAL = json.loads((FIX / "h200-int4-2026-12-04-serial.json").read_text())
MATRICES = [(s, m) for s, v in PDL["int4"].items() for m in v]


def test_the_two_runs_time_the_same_configurations_on_the_same_card():
    assert PDL["device"] == SERIAL["device"] == "NVIDIA H200" and len(MATRICES) == 10
    for s, m in MATRICES:
        a, b = PDL["int4"][s][m], SERIAL["int4"][s][m]
        assert set(a["configs"]) == set(b["configs"]) and len(a["configs"]) == 7
        assert a["bytes"] == b["bytes"]


@pytest.mark.parametrize("shape_set,matrix", MATRICES)
def test_each_matrix_is_faster_with_the_gemv_launched_during_its_row_kernel(shape_set, matrix):
    a, b = PDL["int4"][shape_set][matrix], SERIAL["int4"][shape_set][matrix]
    assert a["best"]["us"] < b["best"]["us"]
    for cfg, c in a["configs"].items():
        assert c["rel_err"] < 1e-2 and b["configs"][cfg]["rel_err"] < 1e-2


def test_the_saving_is_tenths_of_a_microsecond_a_product_not_the_predicted_one_to_one_and_a_half():
    saved = [SERIAL["int4"][s][m]["best"]["us"] - PDL["int4"][s][m]["best"]["us"] for s, m in MATRICES]
    assert 0.2 < sum(saved) / len(saved) < 0.7  # 0.08 - 0.49 us, mean 0.35
    assert PDL["int4_summary"]["bytes_weighted_fraction"] > SERIAL["int4_summary"]["bytes_weighted_fraction"]


@pytest.mark.parametrize("ctx", ["1024", "131072"])
def test_the_step_loses_idle_time_but_gains_under_a_percent(ctx):
    a, b = PDL["step"]["contexts"][ctx], SERIAL["step"]["contexts"][ctx]
    assert a["profile"]["idle_us"] < b["profile"]["idle_us"] - 50  # 274 -> 204 us at 1K
    assert a["ms"] == pytest.approx(b["ms"], rel=0.015)  # 6.90 -> 6.84 ms at 1K, 9.13 -> 9.06 ms at 128K
    assert a["ms"] < b["ms"]


def test_the_gpu_tests_with_pdl_on_passed_the_replay_test_among_them():
    suite = junit_suite(FIX / "h200-gpu-tests-pdl-2026-12-04.xml")
    assert (int(suite.get("tests")), int(suite.get("failures")), int(suite.get("errors"))) == (45, 0, 0)
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    pdl = cases["test_the_gemv_launched_during_its_row_kernel_reads_this_calls_input_on_every_replay"]
    assert pdl.find("skipped") is None and pdl.find("failure") is None
    skipped = [c for c in cases.values() if c.find("skipped") is not None]
    assert len(skipped) == 1 and "two CUDA GPUs" in skipped[0].find("skipped").get("message")
