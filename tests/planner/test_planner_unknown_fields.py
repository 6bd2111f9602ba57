"""Issue 45: a config field the planner does not understand is refused by name (exit 2) or planned with an explicit
"unmodelled: X" and a wider interval; never a silent number. Not timed."""

from __future__ import annotations

import json
import math

import pytest

from tests.paths import REPO
from v100plan.planner import config_fields

QWEN3 = REPO / "engine/data/qwen3-8b.config.json"


def _raw(tmp_path, **extra) -> str:
    cfg = json.loads(QWEN3.read_text())
    cfg.update(extra)
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize("field, value", [
    ("hc_mult", 4),                                   # hyper-connections
    ("num_hyper_connections", 4),
    ("hidden_size_per_layer_input", 256),             # per-layer embeddings (Gemma 3n)
    ("vocab_size_per_layer_input", 262144),
    ("ngram_vocab_size", 1000000),                    # n-gram embeddings
    ("index_n_heads", 64),                            # a sparse-attention indexer
    ("altup_num_inputs", 4),
    ("num_kv_shared_layers", 10),
])
def test_a_structure_with_no_formula_is_refused_by_name(cli, tmp_path, field, value):
    r = cli("plan", "--model", _raw(tmp_path, **{field: value}), "--hardware", "h200", "--gpus", "1", "--context", "8K")
    assert r.exit_code == 2, r.stdout
    err = " ".join(r.stderr.split())
    assert field in r.stderr and "does not model it" in err and "Traceback" not in r.stderr


def test_gemma_3n_as_transformers_writes_it_is_refused(cli, tmp_path):
    from transformers import Gemma3nTextConfig

    d = tmp_path / "g"
    d.mkdir()
    Gemma3nTextConfig().to_json_file(str(d / "config.json"))
    r = cli("plan", "--model", str(d), "--hardware", "h200", "--gpus", "1", "--context", "8K")
    assert r.exit_code == 2 and "Traceback" not in r.stderr


def test_an_unknown_field_is_planned_with_a_warning_and_a_wider_interval(cli, tmp_path):
    plain = cli.json("plan", "--model", str(QWEN3), "--hardware", "h200", "--gpus", "1", "--context", "8K",
                     "--weights", "bf16")
    odd = cli.json("plan", "--model", _raw(tmp_path, moe_shortcut_ratio=0.5), "--hardware", "h200", "--gpus", "1",
                   "--context", "8K", "--weights", "bf16")
    assert any("unmodelled: config.json field 'moe_shortcut_ratio'" in n for n in odd["notes"])
    assert any(n.startswith("unmodelled: ") and "intervals are widened" in n for n in odd["notes"])
    a, b = (next(s for s in d["strategies"] if s["name"] == "single") for d in (plain, odd))
    assert a["decode_tok_s"] == b["decode_tok_s"]                         # the number is the same arithmetic
    width = [math.log(s["decode_tok_s_interval"][1] / s["decode_tok_s_interval"][0]) for s in (a, b)]
    assert width[1] > width[0] + 0.3 and "unmodelled" in b["interval_source"]
    assert not [n for n in plain["notes"] if "unmodelled" in n]


def test_the_known_fields_cover_the_configs_the_catalogue_and_engine_ship():
    for path in list((REPO / "profiles/published/configs").glob("*.json")) + list((REPO / "engine/data").glob("*.config.json")):
        assert config_fields.unknown(json.loads(path.read_text())) == [], path.name
    assert config_fields.refused("hc_anything") and config_fields.refused("rms_norm_eps") is None


NEW_CARDS = {"rtx3090-ti": (84, 1008.0, "ampere"), "rtx3080": (68, 760.0, "ampere"), "rtx-a6000": (84, 768.0, "ampere"),
             "rtx5060-ti-16g": (36, 448.0, "blackwell"), "rtx5080": (84, 960.0, "blackwell"),
             "rtx5090": (170, 1792.0, "blackwell"), "v100s-pcie-32gb": (80, 1134.0, "volta")}


@pytest.mark.parametrize("card", sorted(NEW_CARDS))
def test_each_new_card_is_catalogued_from_its_datasheet_and_planned(cli, card):
    """Issue 45: the cards the planner could not express. Every figure cites its datasheet or whitepaper; a figure
    not taken from one (consumer Blackwell's dense tensor rate) is null with its reason, so prefill is not guessed."""
    from v100plan import catalogue

    doc = catalogue.get("hardware", card)
    sms, bw, arch = NEW_CARDS[card]
    assert (doc["sm_count"], doc["mem_bw_nominal_gbps"], doc["architecture"]) == (sms, bw, arch)
    assert doc["mem_bw_nominal_gbps"] == pytest.approx(doc["mem_clock_max_mhz"] * 2 * doc["bus_width_bits"] / 8 / 1e3, rel=1e-3)
    p = cli.json("plan", "--hardware", card, "--gpus", "1", "--model", "llama3.1-8b-fp16", "--weights", "q4_k_m",
                 "--context", "4K", "--engine", "llamacpp")
    s = p["strategies"][0]
    assert s["fits"] and s["decode_tok_s"] < s["decode_ceiling_tok_s"] and s["decode_tok_s_interval"]
    if doc["fp16_tensor_tflops"] is None:
        assert "datasheet" in doc["unavailable"]["fp16_tensor_tflops"]
