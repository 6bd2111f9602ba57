"""Speeds where an engine has no calibration: the fixed stand-in chain (v100plan/planner/calibration.py), said in
the plan, recorded in its document and marked in compare; never silent. Not timed; about 2 s."""

from __future__ import annotations

import copy
import json

import pytest

from tests.paths import REPO
from v100plan import catalogue, documents, plan_inputs
from v100plan.planner import Target, engine_from_doc, hardware_from_doc, model_from_doc, plan
from v100plan.planner.calibration import COMPUTE_CAPABILITY, nearest_generation, resolve

K = 1024
LLAMA8 = "llama3.1-8b-fp16"


def _plan(hw: str, engine: str | dict, gpus: int = 1, model: str = LLAMA8, context: int = 4 * K):
    e = engine_from_doc(engine if isinstance(engine, dict) else catalogue.get("engine", engine), catalogue.engine_docs())
    return plan(hardware_from_doc(catalogue.get("hardware", hw), gpus), model_from_doc(catalogue.get("model", model)), e,
                Target(context_tokens=context, gpus=gpus))


def _engine(eid: str):
    return plan_inputs.engine(eid)


@pytest.mark.parametrize("hw", ["rtx4090-24g", "h100-sxm", "h200", "l40s"])
def test_vllm_off_its_generations_takes_its_nearest_ones_figures_and_says_so(hw):
    """vLLM is calibrated on Volta and Ampere: Ada (8.9) and Hopper (9.0) take its Ampere (8.0) figures."""
    p = _plan(hw, "vllm")
    s = p.strategy("single")
    volta = _engine("vllm").by_generation["ampere"]
    assert s.decode_tok_s is not None and p.recommended == "single"
    assert s.breakdown["decode"]["weight_bw_fraction"] == volta["weight_bw_fraction"].value
    assert s.breakdown["decode"]["kv_bw_fraction"] == volta["kv_bw_fraction"].value
    assert p.speeds["calibrated"] is False
    assert p.speeds["stand_in"]["kind"] == "nearest_generation"
    assert (p.speeds["stand_in"]["engine"], p.speeds["stand_in"]["generation"], p.speeds["stand_in"]["format"]) == \
        ("vllm", "ampere", "default")
    assert s.breakdown["decode"]["overhead_per_layer_ms"] == volta["round_overhead_per_layer_ms"].value
    assert p.why[0].startswith("speeds NOT calibrated for vllm on ")
    assert any(n.startswith("speeds not calibrated: engine vllm has no ") and "its ampere figures stand in" in n for n in p.notes)


def test_vllm_on_its_own_generation_is_calibrated():
    p = _plan("v100-pg500-216", "vllm", gpus=2, model="qwen3.8-27b-nvfp4", context=8 * K)
    assert p.speeds["calibrated"] is True and p.speeds["stand_in"] is None
    a = _plan("a100-pcie-40gb", "vllm")
    assert a.speeds["calibrated"] is True and a.speeds["stand_in"] is None
    assert not any("NOT calibrated" in line for line in p.why)
    assert not any(n.startswith("speeds not calibrated") for n in p.notes)


def test_sglang_takes_vllm_through_its_named_sibling():
    p = _plan("h100-sxm", "sglang")
    s = p.speeds["stand_in"]
    assert p.strategy("single").decode_tok_s is not None
    assert s["kind"] == "sibling_engine" and s["engine"] == "vllm" and s["generation"] == "ampere"
    assert s["sibling_stand_in"]["kind"] == "nearest_generation"
    assert "SGLang's README" in s["why"]
    assert p.strategy("single").breakdown["decode"]["speeds_engine"] == "vllm"
    # the sibling's figures, not the sibling's plan: the same round on the same card
    assert p.strategy("single").decode_tok_s == _plan("h100-sxm", "vllm").strategy("single").decode_tok_s
    # on Volta the sibling is calibrated: the stand-in is the sibling alone
    v = _plan("v100-pg500-216", "sglang", gpus=2, model="qwen3.8-27b-nvfp4", context=8 * K)
    assert v.speeds["stand_in"]["kind"] == "sibling_engine" and "sibling_stand_in" not in v.speeds["stand_in"]
    assert v.speeds["calibrated"] is False


@pytest.mark.parametrize("hw, gen", [("h100-sxm", "hopper"), ("v100-pg500-216", "volta"), ("rtx4090-24g", "ada")])
def test_gpt_fast_off_ampere_takes_its_ampere_figures(hw, gen):
    p = _plan(hw, "gpt-fast")
    assert p.speeds["stand_in"]["kind"] == "nearest_generation" and p.speeds["stand_in"]["generation"] == "ampere"
    assert p.speeds["generation"] == gen
    d = p.strategy("single").breakdown["decode"]
    assert d["overhead_per_layer_ms"] == _engine("gpt-fast").by_generation["ampere"]["round_overhead_per_layer_ms"].value


def test_a_format_without_its_own_figure_is_a_recorded_stand_in():
    """gpt-fast on Ampere is calibrated for bf16 and int8: bf16 is calibrated, fp16 takes the generation's default."""
    bf16 = resolve(_engine("gpt-fast"), "bf16", "float", "ampere", 1)
    fp16 = resolve(_engine("gpt-fast"), "fp16", "float", "ampere", 1)
    assert bf16.stand_in is None and bf16.complete
    assert fp16.stand_in["kind"] == "format" and fp16.stand_in["format"] == "default"
    assert fp16.weight.value == _engine("gpt-fast").by_generation["ampere"]["weight_bw_fraction"].value


def test_nearest_generation_is_by_compute_capability_and_a_tie_goes_to_the_newer():
    doc = copy.deepcopy(catalogue.get("engine", "gpt-fast"))
    doc["by_generation"]["volta"] = copy.deepcopy(doc["by_generation"]["ampere"])
    doc["by_generation"]["volta"]["weight_bw_fraction"]["value"] = 0.5
    e = engine_from_doc(doc, catalogue.engine_docs())
    assert COMPUTE_CAPABILITY["turing"] - COMPUTE_CAPABILITY["volta"] == COMPUTE_CAPABILITY["ampere"] - COMPUTE_CAPABILITY["turing"]
    assert nearest_generation(e, "turing", "fp16", "float") == "ampere"      # 7.5: 7.0 and 8.0 tie, the newer wins
    assert nearest_generation(e, "hopper", "fp16", "float") == "ampere"
    assert nearest_generation(e, "volta", "fp16", "float") == "ampere"       # itself excluded (it is asked for)
    assert nearest_generation(e, "", "fp16", "float") is None                # unknown generation: no neighbour
    assert resolve(e, "fp16", "float", "volta", 1).stand_in["kind"] == "format"  # its own entry comes first


def test_an_engine_with_nothing_to_stand_in_gives_the_ceiling_only():
    p = _plan("a100-80gb", "llamacpp-layer", gpus=2)
    assert p.recommended is None and p.speeds["missing"] == ["kv_bw_fraction"]
    assert p.speeds["calibrated"] is False and p.speeds["stand_in"] is None
    assert all(s.decode_ceiling_tok_s for s in p.strategies if s.fits)


def test_a_stand_in_cycle_ends():
    doc = copy.deepcopy(catalogue.get("engine", "sglang"))
    doc["stand_in_engine"]["id"] = "sglang"
    assert engine_from_doc(doc, catalogue.engine_docs()).stand_in_engine is None
    vllm = copy.deepcopy(catalogue.get("engine", "vllm"))
    vllm["stand_in_engine"] = {"id": "sglang", "source": "test"}
    e = engine_from_doc(vllm, catalogue.engine_docs())
    assert e.stand_in_engine.id == "sglang" and e.stand_in_engine.stand_in_engine is None


def test_never_silent_over_the_catalogue():
    """Every engine on every catalogue card: speeds that a stand-in gave come with the Why line and a note; calibrated
    speeds with neither; and every plan document (with its 'speeds' record) is schema-valid."""
    from profiles.document import SCHEMA_VERSIONS, provenance

    for eid in catalogue.ids("engine"):
        for hw in catalogue.ids("hardware"):
            p = _plan(hw, eid, gpus=2, model=LLAMA8, context=4 * K)
            documents.validate({"kind": "plan", "schema_version": SCHEMA_VERSIONS["plan"], "provenance": provenance({}),
                                **p.to_dict()}, "plan", source="test")
            said = bool(p.why) and p.why[0].startswith("speeds NOT calibrated")
            if p.recommended is None:
                assert not said, (eid, hw)
                continue
            stand_in = p.speeds["stand_in"]
            assert said == (stand_in is not None), (eid, hw)
            if stand_in and stand_in["kind"] in ("nearest_generation", "sibling_engine"):
                assert any(n.startswith("speeds not calibrated") for n in p.notes), (eid, hw)


def test_the_plan_schema_refuses_a_stand_in_without_its_parts():
    from v100plan.errors import DocumentError

    doc = json.loads(json.dumps(_plan("h100-sxm", "vllm").to_dict()))
    from profiles.document import SCHEMA_VERSIONS, provenance

    base = {"kind": "plan", "schema_version": SCHEMA_VERSIONS["plan"], "provenance": provenance({})}
    documents.validate({**base, **doc}, "plan", source="test")
    bad = copy.deepcopy(doc)
    bad["speeds"]["stand_in"]["kind"] = "guess"
    with pytest.raises(DocumentError):
        documents.validate({**base, **bad}, "plan", source="test")
    bad = copy.deepcopy(doc)
    del bad["speeds"]["calibrated"]
    with pytest.raises(DocumentError):
        documents.validate({**base, **bad}, "plan", source="test")


def test_plan_json_carries_the_record(cli):
    doc = cli.json("plan", "--hardware", "h100-sxm", "--gpus", "1", "--model", LLAMA8, "--engine", "sglang", "--context", "4K")
    assert doc["speeds"]["engine"] == "sglang" and doc["speeds"]["generation"] == "hopper"
    assert doc["speeds"]["calibrated"] is False and doc["speeds"]["stand_in"]["engine"] == "vllm"
    assert doc["recommended"] == "single" and doc["strategies"][0]["decode_tok_s"] > 0


def test_compare_marks_stand_in_speeds(cli):
    args = ("compare", "--engine", "vllm", "--model", "qwen3.8-27b-nvfp4", "--context", "8K", "v100-pg500-216x2", "rtx4090-48g",
            "h100-sxmx8")
    doc = cli.json(*args)
    rows = {r["hardware"]: r for r in doc["rows"]}
    assert rows["v100-pg500-216"]["speeds_calibrated"] is True and rows["v100-pg500-216"]["speeds_stand_in"] is None
    assert rows["rtx4090-48g"]["speeds_calibrated"] is False
    assert "vllm's ampere default figures stand in" in rows["rtx4090-48g"]["speeds_stand_in"]
    assert rows["h100-sxm"]["best_strategy"] == "tp8" and rows["h100-sxm"]["decode_tok_s"] > 0
    text = cli(*args).stdout
    lines = text.splitlines()
    v100 = next(line for line in lines if "v100-pg500" in line or line.startswith("│ 2 x"))
    ada = next(line for line in lines if line.startswith("│ 1 x") and f"{rows['rtx4090-48g']['decode_tok_s']:.1f}" in line)
    assert "~" not in v100 and f"~{rows['rtx4090-48g']['decode_tok_s']:.1f}" in ada
    assert any(line.startswith("~ 1 x rtx4090-48g: speeds NOT calibrated for vllm on ada") for line in lines)


def test_the_stand_in_points_are_held_out_and_not_in_any_profile():
    """The published vLLM/SGLang figures off Volta judge the chain; no engine profile was set from them."""
    from v100plan import plan_accuracy as accuracy

    pts = {p["id"]: p for p in accuracy.load_points()["points"]}
    for pid in ("vllm-h100-l31-8b-bf16", "sglang-h100-l2-7b-fp16", "gptfast-4090-l2-7b-bf16"):
        assert pts[pid]["role"] == "held_out"
        for eid in ("vllm", "sglang", "gpt-fast"):
            text = json.dumps(catalogue.get("engine", eid))
            assert f"{pts[pid]['decode_tok_s']:g} tok" not in text and f" {pts[pid]['decode_tok_s']:g} " not in text


def test_bench_planner_reports_the_stand_in_points_apart():
    """The held-out points a stand-in predicted are summed up on their own: the chain is judged, not averaged away."""

    from v100plan import plan_accuracy as accuracy

    rows = accuracy.evaluate(REPO)
    st = accuracy.summary(rows)["held_out_stand_in"]
    assert {"vllm-h100-l31-8b-bf16", "sglang-h100-l2-7b-fp16", "gptfast-4090-l2-7b-bf16", "lcpp-a100-l3-8b-f16"} <= set(st["ids"])
    by_id = {r.id: r for r in rows}
    assert "vllm's ampere default figures stand in" in by_id["sglang-h100-l2-7b-fp16"].speeds_stand_in
    assert by_id["gptfast-a100-l2-7b-bf16"].speeds_stand_in is None      # calibrated where it was calibrated
    errs = [abs(by_id[i].error) for i in st["ids"]]
    assert st["points"] == len(errs) and st["worst_abs_error"] == max(errs)


def test_a_stand_in_that_is_not_in_the_catalogue_is_bad_input(cli, tmp_path):
    doc = copy.deepcopy(catalogue.get("engine", "sglang"))
    doc["stand_in_engine"]["id"] = "text-generation-inference"
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(doc))
    r = cli("plan", "--engine", str(path), "--hardware", "h100-sxm", "--gpus", "1", "--model", LLAMA8)
    assert r.exit_code == 2 and "$.stand_in_engine.id" in r.stderr and "text-generation-inference" in r.stderr
    assert "Traceback" not in r.stderr
