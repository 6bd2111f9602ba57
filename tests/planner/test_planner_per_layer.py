"""A round overhead per layer (engine profile 'round_overhead_per_layer_ms'): the round pays it for every
layer of the model, on every rank and every pipeline stage, so tensor parallel does not divide it.
gpt-fast's Ampere figures are the fit of its one-card calibration points alone. Not timed; well under a second."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest

from tests.paths import REPO
from v100plan import catalogue, documents, plan_inputs
from v100plan import plan_accuracy as accuracy
from v100plan.planner import Target, engine_from_doc, hardware_from_doc, plan

CONFIGS = REPO / "profiles/published/configs"


def _gptfast(doc=None):
    return engine_from_doc(doc or catalogue.get("engine", "gpt-fast"))


def _model(name, weights, engine):
    return plan_inputs.load_model(str(CONFIGS / f"{name}.config.json"), weights, None, engine)[0]


def _plan(name, weights, gpus=8, engine=None, nodes=1, context=128):
    engine = engine or _gptfast()
    hw = hardware_from_doc(catalogue.get("hardware", "a100-80gb"), gpus, nodes)
    return plan(hw, _model(name, weights, engine), engine, Target(context, gpus))


def test_the_overhead_is_per_layer_and_tensor_parallel_does_not_divide_it():
    """Every strategy of one model pays the same overhead, per layer x its layers; the 70B's 80 layers pay
    80/32 of what the 7B's 32 do, and the weight reads are what tensor parallel shrinks."""
    per_layer = _gptfast().per_layer_overhead("ampere").value
    overheads = {}
    for name, layers in (("llama-2-7b", 32), ("llama-2-70b", 80)):
        p = _plan(name, "int8")
        decode = {s.name: s.breakdown["decode"] for s in p.strategies if s.fits}
        assert {"single", "tp2", "tp4", "tp8"} <= set(decode)
        for d in decode.values():
            assert d["layers"] == layers
            assert d["overhead_ms"] == pytest.approx(per_layer * layers, abs=1e-3)
        assert decode["tp8"]["weights_ms"] < decode["tp2"]["weights_ms"] / 3
        overheads[name] = decode["single"]["overhead_ms"]
    assert overheads["llama-2-70b"] / overheads["llama-2-7b"] == pytest.approx(80 / 32, rel=1e-3)


def test_the_plan_shows_the_per_layer_arithmetic():
    p = _plan("llama-2-70b", "int8", gpus=1)
    per_layer = _gptfast().per_layer_overhead("ampere").value
    line = next(w for w in p.why if "overhead" in w)
    assert line.startswith(f"per-round overhead {per_layer:g} ms x 80 layers = {per_layer * 80:.2f} ms"), line
    assert "per layer" in line


def test_pipeline_stages_still_pay_every_layer():
    """Across two boxes each stage runs its half of the layers, one stage after the other: the round pays all 80."""
    doc = copy.deepcopy(catalogue.get("engine", "gpt-fast"))
    doc["multi_node"] = True
    engine = _gptfast(doc)
    p = _plan("llama-2-70b", "bf16", gpus=8, engine=engine, nodes=2)
    staged = p.strategy("tp8_pp2")
    assert staged.fits, staged.reason
    one_box = p.strategy("tp8").breakdown["decode"]["overhead_ms"]
    assert staged.breakdown["decode"]["overhead_ms"] == pytest.approx(one_box)
    assert staged.breakdown["decode"]["overhead_ms"] == pytest.approx(80 * engine.per_layer_overhead("ampere").value, abs=1e-3)


def test_an_engine_without_it_keeps_its_constant_overhead():
    """llama.cpp's Ampere overhead is one figure per round, whatever the model's layer count."""
    engine = plan_inputs.engine("llamacpp")
    assert engine.per_layer_overhead("ampere").value is None
    constant = engine.by_generation["ampere"]["round_overhead_ms"].value
    for name in ("llama-3-8b", "llama-3-70b"):
        d = _plan(name, "q4_k_m", gpus=1, engine=engine).strategy("single").breakdown["decode"]
        assert d["overhead_ms"] == pytest.approx(constant, abs=1e-3)
        assert "overhead_per_layer_ms" not in d


def test_a_separate_draft_model_pays_the_per_layer_overhead_for_its_steps():
    """Without the draft's own layer count each draft step is priced at the target's layers, and the plan says so."""
    engine = _gptfast()
    per_layer = engine.per_layer_overhead("ampere").value
    target = _model("llama-2-70b", "int8", engine)
    draft = _model("llama-2-7b", "int8", engine)
    m = replace(target, draft_kind="model", draft_read_gb=draft.decode_read_gb, max_draft_tokens=4)
    hw = hardware_from_doc(catalogue.get("hardware", "a100-80gb"), 1)
    fw = engine.by_generation["ampere"]["weight_bw_fraction_by_format"]["int8"].value
    step = draft.decode_read_gb / (hw.card.read_bw.value * fw) * 1e3
    for layers, note in ((0, True), (32, False)):
        p = plan(hw, replace(m, draft_layers=layers), engine, Target(128, 1, acceptance=0.8, draft_tokens=4))
        d = p.strategy("single").breakdown["decode"]
        assert d["draft_ms"] == pytest.approx(4 * (step + per_layer * (layers or 80)), abs=2e-3)
        assert any("draft model's layer count is not known" in n for n in p.notes) == note


def test_the_schema_takes_it_per_generation_and_refuses_a_negative_one():
    doc = copy.deepcopy(catalogue.get("engine", "gpt-fast"))
    documents.validate(doc, "engine_profile")
    doc["efficiency"]["round_overhead_per_layer_ms"] = {"value": 0.05, "source": "test"}
    documents.validate(doc, "engine_profile")
    doc["by_generation"]["ampere"]["round_overhead_per_layer_ms"]["value"] = -0.01
    assert documents.problems(doc, "engine_profile")


def _published(pid):
    return next(p for p in accuracy.load_points()["points"] if p["id"] == pid)


def test_gptfast_ampere_figures_are_the_fit_of_its_calibration_points_only():
    """Solve t = (weights + KV) / (bandwidth x f) + layers x y on the two 8-bit one-card points, then the bf16
    fraction from the 7B Base point; the profile's rounded figures are that solution. None of the points is
    held out, and every tensor-parallel point is."""
    engine = _gptfast()
    bw = hardware_from_doc(catalogue.get("hardware", "a100-80gb"), 1).card.read_bw.value
    ids = ("gptfast-a100-l2-7b-int8", "gptfast-a100-l2-70b-int8", "gptfast-a100-l2-7b-bf16")
    points = [_published(i) for i in ids]
    assert all(p["role"] == "calibration" and p["gpus"] == 1 for p in points)
    assert all(p["role"] == "held_out" for p in accuracy.load_points()["points"]
               if p["engine"] == "gpt-fast" and p["gpus"] > 1)
    rows = []
    for p in points:
        m = _model(Path(p["model"]).name.removesuffix(".config.json"), p["weights"], engine)
        rows.append((m.decode_read_gb + m.kv_bytes_per_token * p["context_tokens"] / 1e9, m.layers, 1e3 / p["decode_tok_s"]))
    (g1, l1, t1), (g2, l2, t2), (g3, l3, t3) = rows
    x = (t2 - t1 * l2 / l1) / (g2 - g1 * l2 / l1)          # ms per GB = 1e3 / (bw x f)
    y = (t1 - g1 * x) / l1                                   # ms per layer
    f8 = 1e3 / (bw * x)
    fb = g3 / (bw * (t3 - l3 * y)) * 1e3
    amp = engine.by_generation["ampere"]
    assert amp["round_overhead_per_layer_ms"].value == pytest.approx(y, abs=5e-5)
    assert amp["round_overhead_ms"].value == 0.0
    assert amp["weight_bw_fraction_by_format"]["int8"].value == pytest.approx(f8, abs=5e-4)
    assert amp["weight_bw_fraction_by_format"]["bf16"].value == pytest.approx(fb, abs=5e-4)
    assert amp["round_overhead_per_layer_ms"].source.startswith("calibrated:")


def test_gptfast_70b_tensor_parallel_rows_fall_inside_the_allreduce_range():
    """With the overhead per layer, the one figure these held-out rows still lack is the allreduce's, which
    the source gives only as a range (6-15 us): each 70B row's published speed lies between the predictions at
    the range's two ends. (The 7B rows do not: they are faster than even the low end predicts.)"""
    low = {r.id: r for r in accuracy.evaluate(REPO, range_end="low")}
    high = {r.id: r for r in accuracy.evaluate(REPO, range_end="high")}
    rows70 = [pid for pid, r in low.items() if r.engine == "gpt-fast" and r.gpus > 1 and "70b" in r.model]
    assert len(rows70) == 5              # bf16 tp2/4/8, 8-bit and 4-bit tp8
    for pid in rows70:
        assert high[pid].predicted_tok_s <= low[pid].published_tok_s <= low[pid].predicted_tok_s, pid


def test_the_catalogue_gives_a_separate_draft_model_its_own_layer_count():
    """A draft model loaded through the catalogue carries its layers, so its steps pay its own per-layer overhead."""
    engine = _gptfast()
    m = plan_inputs.load_model(str(CONFIGS / "llama-2-70b.config.json"), "int8", None, engine,
                             str(CONFIGS / "llama-2-7b.config.json"), 4)[0]
    assert m.draft_kind == "model" and m.draft_layers == 32 and m.layers == 80
    hw = hardware_from_doc(catalogue.get("hardware", "a100-80gb"), 8, 1)
    p = plan(hw, m, engine, Target(128, 8, acceptance=0.8, draft_tokens=4))
    assert not any("draft model's layer count is not known" in n for n in p.notes)


def _points(engine: str):
    return {p["id"]: p for p in accuracy.load_points()["points"] if p["engine"] == engine}


def test_exllamav2_fraction_and_cost_per_layer_solve_its_two_calibration_points():
    """Ada: the README's 7B at 4.0 bits (32 layers) and 70B at 2.5 bits (80 layers) are two equations in the weight
    fraction f and the cost per layer y; the profile holds their solution, and every other EXL2 row is held out."""
    e = plan_inputs.engine("exllamav2")
    pts = _points("exllamav2")
    assert {i for i, p in pts.items() if p["role"] == "calibration"} == {"exl2-4090-l2-7b-4.0", "exl2-4090-l2-70b-2.5"}
    rows = []
    for pid, name in (("exl2-4090-l2-7b-4.0", "llama-2-7b"), ("exl2-4090-l2-70b-2.5", "llama-2-70b")):
        m = _model(name, pts[pid]["weights"], e)
        read_ms = (m.decode_read_gb + m.kv_bytes_per_token * 128 / 1e9) / 1008.0 * 1e3
        rows.append((read_ms, m.layers, 1e3 / pts[pid]["decode_tok_s"]))
    (a1, l1, r1), (a2, l2, r2) = rows
    x = (r1 * l2 - r2 * l1) / (a1 * l2 - a2 * l1)
    y = (a1 * r2 - a2 * r1) / (a1 * l2 - a2 * l1)
    ada = e.by_generation["ada"]
    assert ada["weight_bw_fraction"].value == pytest.approx(1 / x, abs=5e-4)
    assert ada["round_overhead_per_layer_ms"].value == pytest.approx(y, abs=5e-5)


def test_exl2_bits_are_a_format_with_a_6_bit_head():
    from v100plan.planner.formats import weight_format

    f = weight_format("exl2-4.65")
    assert f and f.bits_per_weight == 4.65 and f.family == "exl2" and f.head_bits == 6.0
    assert weight_format("exl2-9.0") is None and weight_format("exl2-x") is None
    m16 = _model("llama-2-7b", "fp16", None)
    m4 = _model("llama-2-7b", "exl2-4.0", None)
    head = 32000 * 4096
    assert m16.head_gb == pytest.approx(head * 2 / 1e9, abs=1e-4) and m4.head_gb == pytest.approx(head * 6 / 8 / 1e9, abs=1e-4)


def test_vllm_on_ampere_is_its_one_point_with_gpt_fasts_cost_per_layer():
    e = plan_inputs.engine("vllm")
    amp = e.by_generation["ampere"]
    per_layer = amp["round_overhead_per_layer_ms"]
    assert per_layer.value == _gptfast().by_generation["ampere"]["round_overhead_per_layer_ms"].value
    assert "NOT fitted on a vLLM figure" in per_layer.source
    p = _points("vllm")["vllm-a100-40gb-l31-8b-bf16"]
    assert p["role"] == "calibration"
    m = _model("llama-3-8b", "bf16", e)
    gb = m.decode_read_gb + m.kv_bytes_per_token * p["context_tokens"] / 1e9
    f = gb / 1555.0 / (1e3 / p["decode_tok_s"] - 32 * per_layer.value) * 1e3
    assert amp["weight_bw_fraction"].value == pytest.approx(f, abs=5e-4)


def test_tensorrt_llm_plans_its_ceiling_and_its_launch_command(cli):
    doc = cli.json("plan", "--hardware", "h100-sxm", "--gpus", "2", "--model", str(CONFIGS / "llama-3-8b.config.json"),
                   "--weights", "fp8", "--engine", "tensorrt-llm", "--context", "8K")
    assert doc["recommended"] is None and all(s["decode_tok_s"] is None for s in doc["strategies"])
    argv = doc["launch"]["commands"][0]["argv"]
    assert argv[:2] == ["trtllm-serve", "MODEL"] and "--tp_size" in argv and "--max_seq_len" in argv
    assert "fp8" in catalogue.get("engine", "tensorrt-llm")["formats"]["supported"]


def test_gpt_fast_int4_fraction_is_its_one_card_7b_row_with_the_cost_per_layer():
    e = _gptfast()
    amp = e.by_generation["ampere"]
    p = _points("gpt-fast")
    assert p["gptfast-a100-l2-7b-int4"]["role"] == "calibration"
    assert p["gptfast-a100-l2-70b-int4"]["role"] == p["gptfast-a100x8-l2-70b-tp8-int4"]["role"] == "held_out"
    m = _model("llama-2-7b", "int4-g32", e)
    gb = m.decode_read_gb + m.kv_bytes_per_token * 128 / 1e9
    ms = 1e3 / 196.80 - 32 * amp["round_overhead_per_layer_ms"].value
    assert amp["weight_bw_fraction_by_format"]["int4-g32"].value == pytest.approx(gb / 2039.0 / ms * 1e3, abs=5e-4)
    assert amp["weight_bw_fraction_by_format"]["int4-g32"].value < amp["weight_bw_fraction_by_format"]["int8"].value
