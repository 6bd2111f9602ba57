"""The bundled engine's own figure for 4-bit groupwise weights (GPTQ / AWQ) on Hopper comes from its int4 bench
recording (tests/fixtures/engine/h200-int4-2026-12-03-tiles.json: the words held in tiles, as the engine holds them
on a GPU), and the planner plans GPTQ / AWQ models with it."""

from __future__ import annotations

import json

import pytest

from tests.paths import REPO
from v100plan import catalogue
from v100plan.planning import plan_document

NAME = "h200-int4-2026-12-03-tiles.json"
REC = json.loads((REPO / "tests/fixtures/engine" / NAME).read_text())
BEFORE = json.loads((REPO / "tests/fixtures/engine/h200-int4-2026-12-02.json").read_text())
PROFILE = catalogue.get("engine", "v100plan")
HOPPER = PROFILE["by_generation"]["hopper"]
INT4 = ("int4-gptq", "int4-awq", "int4-groupwise")


def recomputed() -> tuple[float, float]:
    """(weight fraction from the 1K step, the 128K step predicted with it) from the recording and the profile's
    own hopper K/V fraction and round overhead."""
    st, bw = REC["step"], REC["read_bw_gbps"] * 1e9  # the step ran in the same process as that measurement
    oh, fk = HOPPER["round_overhead_ms"]["value"], HOPPER["kv_bw_fraction"]["value"]
    c, far = st["contexts"]["1024"], st["contexts"]["131072"]
    w_ms = c["ms"] - oh - (c["kv_bytes"] + c["state_bytes"]) / (bw * fk) * 1e3
    fw = st["weight_bytes"] / bw / (w_ms * 1e-3)
    pred = oh + st["weight_bytes"] / (bw * fw) * 1e3 + (far["kv_bytes"] + far["state_bytes"]) / (bw * fk) * 1e3
    return fw, pred


def test_the_int4_fraction_is_the_recorded_step_less_overhead_and_kv():
    fw, pred = recomputed()
    by_fmt = HOPPER["weight_bw_fraction_by_format"]
    for fmt in INT4:  # one kernel and one held layout for GPTQ and AWQ
        assert by_fmt[fmt]["value"] == pytest.approx(fw, abs=5e-4)
        assert NAME in by_fmt[fmt]["source"]
    assert by_fmt["bf16"]["value"] == HOPPER["weight_bw_fraction"]["value"]  # bf16 keeps its measured figure
    assert by_fmt["int4-gptq"]["value"] < by_fmt["bf16"]["value"]  # the int4 GEMV reads slower than the bf16 one
    cal = {c["key"]: c for c in PROFILE["calibration"]}["hopper_int4_step"]
    assert f"{pred:.2f} ms" in cal["arithmetic"]
    far = REC["step"]["contexts"]["131072"]["ms"]
    assert far < pred < 1.3 * far  # held out: pessimistic at 128K (+25 %), by the 8B shape's K/V fraction
    assert REC["step"]["contexts"]["1024"]["ms"] < BEFORE["step"]["contexts"]["1024"]["ms"]  # the figure rose


@pytest.mark.parametrize("weights", [None, "int4-gptq", "int4-awq"])
def test_the_planner_plans_gptq_and_awq_with_it(weights):
    doc = plan_document("h200", 1, "qwen2.5-32b-int4-gptq", "v100plan", "1K", None, 1, "latency", weights=weights)
    d = doc["strategies"][0]["breakdown"]["decode"]
    fmt = weights or "int4-groupwise"
    assert d["weight_bw_fraction"] == HOPPER["weight_bw_fraction_by_format"][fmt]["value"]
    assert NAME in d["fractions_source"]["weight"] and d["speeds_calibrated"]
    assert not [n for n in doc["notes"] if "calibration" in n or "stands in" in n], doc["notes"]
    assert d["weights_ms"] == pytest.approx(d["weights_read_gb"] / (d["bandwidth_gbps"] * d["weight_bw_fraction"])
                                            * 1e3, rel=2e-3)


def test_bf16_keeps_its_figure_and_fp16_has_its_own():
    bf = plan_document("h200", 1, "llama3.1-8b-fp16", "v100plan", "1K", None, 1, "latency", weights="bf16")
    assert bf["strategies"][0]["breakdown"]["decode"]["weight_bw_fraction"] == HOPPER["weight_bw_fraction"]["value"]
    assert not [n for n in bf["notes"] if "stands in" in n]
    fp = plan_document("h200", 1, "llama3.1-8b-fp16", "v100plan", "1K", None, 1, "latency")
    fp16 = HOPPER["weight_bw_fraction_by_format"]["fp16"]["value"]
    assert fp["strategies"][0]["breakdown"]["decode"]["weight_bw_fraction"] == fp16
    assert not [n for n in fp["notes"] if "stands in" in n]
    f = json.loads((REPO / "tests/fixtures/engine/h200-int4-2026-12-01.json").read_text())["fp16_vs_bf16"]
    times = {dt: sum(f[dt][k] for k in ("norm_qkv_us", "norm_gate_up_us", "silu_down_us")) for dt in ("bfloat16", "float16")}
    assert fp16 == pytest.approx(HOPPER["weight_bw_fraction"]["value"] * times["bfloat16"] / times["float16"], abs=5e-4)
