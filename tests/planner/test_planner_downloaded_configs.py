"""Issue 43, the planner's part: configs as downloaded, the family's names, int8 K/V, the workload's acceptance,
launch lines that the bundled engine's own parser takes, external engines labelled. Not timed; about 3 s."""

from __future__ import annotations

import argparse
import copy
import json

import pytest

from tests.paths import REPO
from v100plan import plan_inputs
from v100plan.planning import plan_document

MULTIMODAL = REPO / "tests/fixtures/planner/qwen3.5-27b-gptq-multimodal.config.json"
SHIPPED = REPO / "engine/data/qwen3.5-27b.config.json"


def _write(tmp_path, cfg, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def test_the_multimodal_gptq_layout_plans_as_gptq_and_fits_two_sxm2_with_mtp_and_int8(cli):
    """The newcomer's case of issue 43: text_config nested, quantization_config at the top level."""
    doc = cli.json("plan", "--hardware", "v100-sxm2-32gb", "--gpus", "2", "--model", str(MULTIMODAL),
                   "--kv-cache-dtype", "int8", "--workload", "code", "--context", "186K")
    tp2 = next(s for s in doc["strategies"] if s["name"] == "tp2")
    assert tp2["fits"] and doc["recommended"] == "tp2"
    assert any("int4-gptq, as the checkpoint's config says (quantization_config gptq 4-bit)" in n for n in doc["notes"])
    launch = doc["launch"]
    assert launch["engine"] == "v100plan" and launch["bundled"] and launch["speculative"] == "mtp"
    assert launch["draft_tokens"] == 3 and launch["kv_cache_dtype"] == "int8" and launch["acceptance"] == 0.745
    argv = launch["commands"][0]["argv"]
    assert " ".join(argv).startswith("python -m engine serve --model MODEL --max-context 190464 --dtype float16")
    assert "--kv-cache-dtype int8 --speculative mtp --draft-tokens 3" in " ".join(argv)
    assert any(n.startswith("acceptance 0.745 per draft token (workload code") for n in doc["notes"])


@pytest.mark.parametrize("where", ["top", "inner"])
@pytest.mark.parametrize("q, fmt", [({"quant_method": "gptq", "bits": 4, "group_size": 128}, "int4-gptq"),
                                    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "int4-awq"),
                                    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 128}, "int4-awq"),
                                    ({"quant_method": "auto-round", "bits": 4, "group_size": 128}, "int4-autoround")])
def test_quantization_config_is_read_at_either_level(tmp_path, where, q, fmt):
    cfg = json.loads(MULTIMODAL.read_text())
    del cfg["quantization_config"]
    (cfg if where == "top" else cfg["text_config"])["quantization_config"] = q
    doc, _ = plan_inputs.model_document(_write(tmp_path, cfg))
    assert doc["format"] == fmt
    # 4-bit linear layers, 16-bit embedding and head: far below the bf16 file
    bf16, _ = plan_inputs.model_document(_write(tmp_path, cfg, "b.json"), "bf16")
    assert doc["weights"]["total_gb"] < 0.45 * bf16["weights"]["total_gb"]


def test_a_quantization_config_the_planner_cannot_read_is_refused_not_planned_as_bf16(tmp_path, cli):
    cfg = json.loads(MULTIMODAL.read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    r = cli("plan", "--model", _write(tmp_path, cfg), "--gpus", "2")
    assert r.exit_code == 2 and "bitsandbytes" in r.stderr and "--weights" in r.stderr and "Traceback" not in r.stderr


def test_the_text_only_layout_and_the_shipped_config_carry_the_mtp_layer():
    shipped = json.loads(SHIPPED.read_text())
    assert shipped["mtp_num_hidden_layers"] == 1
    m, _ = plan_inputs.load_model(str(SHIPPED), None, None)
    assert m.draft_kind == "mtp" and m.max_draft_tokens == 3 and m.draft_read_gb > 0
    mm, _ = plan_inputs.load_model(str(MULTIMODAL), None, None)
    assert mm.draft_kind == "mtp" and mm.layers == m.layers == 64 and mm.attention_layers == 16


@pytest.mark.parametrize("name", ["qwen3.5-27b", "qwen3.6-27b", "Qwen/Qwen3.5-27B", "qwen3.5-27b-gptq"])
def test_the_family_is_found_by_the_names_users_give_it(cli, name):
    doc = cli.json("plan", "--model", name, "--context", "32K")
    assert doc["strategies"] and any("the catalogue's qwen3.8-27b-groupwise-int profile" in n for n in doc["notes"])


def test_kv_cache_dtype_int8_is_one_byte_and_its_scale(tmp_path, cli):
    doc = cli.json("plan", "--model", str(SHIPPED), "--kv-cache-dtype", "int8", "--context", "32K", "--gpus", "2")
    assert doc["launch"]["kv_cache_dtype"] == "int8"
    m, _ = plan_inputs.load_model(str(SHIPPED), None, "int8")
    assert m.kv_bytes_per_element == pytest.approx(1 + 4 / 256)       # a float32 scale per position and KV head
    fp16, _ = plan_inputs.load_model(str(SHIPPED), None, "fp16")
    assert m.kv_bytes_per_token < 0.51 * fp16.kv_bytes_per_token


def test_the_workload_chooses_the_acceptance_and_the_plan_shows_it(cli):
    args = ["plan", "--hardware", "v100-sxm2-32gb", "--gpus", "2", "--context", "186K", "--json"]
    code, prose = cli.json(*args[:-1], "--workload", "code"), cli.json(*args[:-1], "--workload", "prose")
    assert code["launch"]["acceptance"] == 0.745 and prose["launch"]["acceptance"] == 0.49
    assert code["inputs"]["workload"] == "code"
    best = {d["inputs"]["workload"]: next(s for s in d["strategies"] if s["name"] == d["recommended"]) for d in (code, prose)}
    ratio = best["code"]["decode_tok_s"] / best["prose"]["decode_tok_s"]
    assert ratio > 1.15                                                   # 1 + 3 x 0.745 against 1 + 3 x 0.49 tokens
    text = cli("plan", "--hardware", "v100-sxm2-32gb", "--gpus", "2", "--workload", "code").stdout
    assert "tokens per round 1 + 3 x 0.745" in text and "workload code" in text
    r = cli("plan", "--workload", "poetry")
    assert r.exit_code == 2 and "--workload must be one of prose, code" in r.stderr


def _serve_parser():
    from engine.service import serve_config

    p = argparse.ArgumentParser()
    serve_config.add_serve_arguments(p)
    return p


@pytest.mark.parametrize("hardware, gpus", [("v100-sxm2-32gb", 2), ("v100-pg500-216", 2), ("h200", 2), ("rtx3090", 1)])
def test_every_fitting_strategy_of_the_bundled_engine_has_a_line_its_parser_takes(cli, hardware, gpus):
    doc = cli.json("plan", "--hardware", hardware, "--gpus", str(gpus), "--model", str(SHIPPED), "--weights", "int4-gptq",
                   "--kv-cache-dtype", "int8", "--context", "8K")
    fitting = [s for s in doc["strategies"] if s["fits"]]
    assert fitting
    parser = _serve_parser()
    for s in fitting:
        cmds = s["launch"]["commands"]
        for c in cmds:
            assert c["argv"][:4] == ["python", "-m", "engine", "serve"]
            ns = parser.parse_args(c["argv"][4:])
            assert ns.max_context == 8192 and ns.kv_cache_dtype == "int8" and ns.dtype == s["launch"]["dtype"]
        assert len(cmds) == (2 if s["name"] == "replicas" else 1)
    split = next(s for s in doc["strategies"] if s["name"] == "layer_split")
    assert not split["fits"] and "does not run layer_split" in split["reason"]


def test_an_external_engine_is_labelled_with_where_to_get_it(cli):
    doc = cli.json("plan", "--engine", "ninfer-v100-tp", "--model", "qwen3.8-27b-nvfp4", "--context", "32K")
    assert doc["launch"]["bundled"] is False and "NInfer-V100-Duo" in doc["launch"]["where"]
    assert any(n.startswith("engine ninfer-v100-tp is external: not bundled with v100plan") for n in doc["notes"])
    vllm = cli.json("plan", "--engine", "vllm", "--model", "llama3.1-8b-fp16", "--hardware", "h200", "--gpus", "1",
                    "--context", "32K")
    assert vllm["launch"]["bundled"] is False and "github.com/vllm-project/vllm" in vllm["launch"]["where"]


def test_an_engine_that_cannot_load_the_format_says_so(cli):
    r = cli("plan", "--model", "qwen3.8-27b-nvfp4", "--context", "32K", "--json")
    assert r.exit_code == 1                                               # nothing fits: the format is not loadable
    doc = json.loads(r.stdout)
    assert all("does not load nvfp4 weights" in s["reason"] for s in doc["strategies"])


def test_the_bundled_engine_on_a_v100_is_its_kernel_model_labelled_uncalibrated():
    doc = plan_document("v100-sxm2-32gb", 2, str(SHIPPED), None, "32K", None, 1, "latency", weights="int4-gptq")
    assert doc["speeds"]["calibrated"] is False and doc["speeds"]["stand_in"]["kind"] == "kernel_model"
    assert doc["why"][0].startswith("speeds NOT calibrated for v100plan on volta")
    note = next(n for n in doc["notes"] if "kernel model stands in" in n)
    assert "ALU bound" in note and "1980 / 1530 MHz" in note
    d = next(s for s in doc["strategies"] if s["name"] == doc["recommended"])["breakdown"]["decode"]
    assert "kernel model (uncalibrated)" in d["fractions_source"]["weight"]


def test_the_kernel_model_caps_the_fraction_when_the_alus_cannot_keep_up():
    from v100plan import catalogue
    from v100plan.planner import hardware_from_doc
    from v100plan.planner.kernel_model import alu_fraction

    e = plan_inputs.engine("v100plan")
    p40 = hardware_from_doc(catalogue.get("hardware", "tesla-p40"), 1).card
    v100 = hardware_from_doc(catalogue.get("hardware", "v100-sxm2-32gb"), 1).card
    km = copy.deepcopy(e.kernel_model)
    # 64 lanes x 80 SMs x 1530 MHz over 6.6 instructions a byte x 878 GB/s
    assert alu_fraction(km, v100, 6.6) == pytest.approx(64 * 80 * 1530e6 / (6.6 * 878e9))
    assert alu_fraction(km, v100, 6.6) > 1.0 and alu_fraction(km, v100, 60.0) < 0.7 > 0
    assert alu_fraction(km, p40, 6.6) == pytest.approx(64 * 30 * 1531e6 / (6.6 * p40.read_bw.value * 1e9))


def test_a_multimodal_config_counts_its_vision_tower_in_memory_and_prices_an_image(tmp_path):
    """The tower (engine.vision.config's parameter count: 0.461 B for the 27B's, at 16 bits) is whole on each rank:
    memory per GPU grows by its bytes, decode does not read it."""
    raw = json.loads(MULTIMODAL.read_text())
    text_only = copy.deepcopy(raw)
    del text_only["vision_config"]
    (tmp_path / "text.json").write_text(json.dumps(text_only))
    docs = [plan_document("v100-sxm2-32gb", 2, str(p), "v100plan", "200K", None, 1, "latency", kv_cache_dtype="int8")
            for p in (MULTIMODAL, tmp_path / "text.json")]
    (mm, text) = [next(s for s in d["strategies"] if s["name"] == "tp2") for d in docs]
    from engine.vision import config as vision_config

    tower_gb = vision_config.from_dict(raw).param_count() * 2 / 1e9
    assert round(tower_gb, 3) == 0.921
    assert mm["breakdown"]["memory"]["weights_gb"] - text["breakdown"]["memory"]["weights_gb"] == pytest.approx(tower_gb, abs=2e-3)
    assert mm["decode_tok_s"] == text["decode_tok_s"]
    notes = " ".join(docs[0]["notes"])
    assert "vision tower: 0.461 B parameters" in notes and "priced for a 1024 x 1024 image" in notes
    assert "image" in mm["breakdown"] and "image" not in text["breakdown"]


def test_an_images_prefill_is_a_floor_under_the_h100_measurement():
    """The plan's image cost on an H100 against the recording of the bundled engine's tower and first token on the
    lent H100 (1024 x 1024 image, 27B shape, bf16): the same patches and image tokens, the tower's time a floor
    within 2x of what it measured (it ran at 1.54x the bench's own prediction), and the whole image's figure
    under the measured cold TTFT of a chat holding it."""
    rec = json.loads((REPO / "tests/fixtures/engine/h100-vision-2026-12-05.json").read_text())
    doc = plan_document("h100-sxm", 1, str(MULTIMODAL), "v100plan", "8K", None, 1, "latency", weights="bf16")
    single = next(s for s in doc["strategies"] if s["name"] == "single")
    img = single["breakdown"]["image"]
    assert (img["image_tokens"], rec["image_tokens"]) == (1024, 1024)
    assert rec["measured"]["tower_ms"] / 2 <= img["tower_ms"] <= rec["measured"]["tower_ms"]
    assert img["total_ms"] < rec["measured"]["ttft_ms"]
    assert any("an image (1024 tokens" in n for n in doc["notes"])
