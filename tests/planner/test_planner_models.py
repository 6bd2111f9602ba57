"""--model from a Hugging Face config.json, --weights, --kv-cache-dtype and speculation terms.

Configs are real: engine/data/*.config.json (published Llama-3.1-8B and Qwen3-8B configs) and
configs written by transformers' own config classes for Qwen3-MoE, Mixtral and Qwen3-Next.
"""

from __future__ import annotations

import json

import pytest

from v100plan import catalogue, documents, plan_inputs
from v100plan.planner import model_from_doc
from v100plan.planner.decode import tokens_per_round
from v100plan.planner.formats import GIB, KV_DTYPES, WEIGHT_FORMATS
from v100plan.planner.from_config import model_doc

LLAMA = "engine/data/llama-3.1-8b.config.json"
QWEN3 = "engine/data/qwen3-8b.config.json"


def _doc(path: str, fmt: str | None = None, kv: str | None = None):
    cfg, src = catalogue.read_config(path)
    return documents.validate(model_doc(cfg, src, fmt, kv), "model_profile")


def _write(tmp_path, cfg_obj) -> str:
    path = tmp_path / "config.json"
    cfg_obj.to_json_file(str(path))
    return str(tmp_path)


def test_llama_config_reproduces_the_curated_catalogue_profile():
    """The catalogue's llama3.1-8b-fp16 was curated by hand from the same config: the shape gives it back."""
    d = _doc(LLAMA, "fp16")
    c = catalogue.get("model", "llama3.1-8b-fp16")
    for k in ("total_gb", "split_gb", "replicated_gb", "decode_read_gb"):
        assert d["weights"][k] == pytest.approx(c["weights"][k], rel=1e-3), k
    assert d["parameters_b"] == pytest.approx(8.03, abs=0.01)
    assert model_from_doc(d).kv_shape_bytes_per_token == 32 * 8 * 128 * 2 * 2


def test_gguf_bits_give_back_llama_cpp_file_sizes():
    """Q4_K_M of Llama-3-8B is 4.58 GiB in llama.cpp's table: the whole-file bits reproduce it."""
    d = _doc(LLAMA, "q4_k_m")
    assert d["weights"]["total_gb"] * 1e9 / GIB == pytest.approx(4.58, rel=0.005)
    assert _doc(LLAMA, "q8_0")["weights"]["total_gb"] * 1e9 / GIB == pytest.approx(7.96, rel=0.005)
    every = set(WEIGHT_FORMATS)
    assert {"fp32", "fp16", "bf16", "fp8", "int8", "int4-awq", "int4-gptq", "nvfp4", "q8_0", "q6_k", "q5_k_m",
            "q4_k_m", "q4_0", "iq4_xs", "q3_k_m", "q2_k"} <= every
    assert all(f.source for f in WEIGHT_FORMATS.values())


def test_checkpoint_4bit_keeps_embedding_and_head_at_16_bits():
    d = _doc(QWEN3, "int4-awq")
    vocab_h = 151936 * 4096
    # embedding + untied head at 2 bytes each = 2.49 GB; the rest at 4.156 bits
    assert d["weights"]["replicated_gb"] == pytest.approx(vocab_h * 2 / 1e9, rel=1e-3)
    assert any("embedding and output head kept at 16 bits" in a for a in d["assumptions"])
    assert d["weights"]["total_gb"] < _doc(QWEN3, "int8")["weights"]["total_gb"] < _doc(QWEN3, "bf16")["weights"]["total_gb"]


def test_qwen3_moe_active_vs_total_experts(tmp_path):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, vocab_size=151936,
                         max_position_embeddings=40960)
    d = _doc(_write(tmp_path, cfg), "bf16")
    m = model_from_doc(d)
    assert d["parameters_b"] == pytest.approx(30.5, rel=0.02)          # Qwen3-30B-A3B: 30.5 B total
    assert m.moe_experts == 128 and m.moe_active_experts == 8
    active = m.matrix_flops_per_token / 2 / 1e9 + 151936 * 2048 / 1e9  # + the embedding, as the model card counts
    assert active == pytest.approx(3.3, rel=0.03)                      # 3.3 B activated
    assert m.moe_expert_gb > 0.9 * m.weights_total_gb - m.decode_read_gb


def test_mixtral_two_of_eight_experts(tmp_path):
    from transformers import MixtralConfig

    d = _doc(_write(tmp_path, MixtralConfig()), "fp16")    # Mixtral-8x7B shape: 46.7 B total, 12.9 B active
    assert d["parameters_b"] == pytest.approx(46.7, rel=0.01)
    assert d["matrix_flops_per_token"] / 2e9 == pytest.approx(12.9, rel=0.02)
    assert d["moe"]["experts"] == 8 and d["moe"]["active_experts"] == 2


def test_hybrid_linear_attention_counts_only_full_layers_for_kv(tmp_path):
    from transformers import Qwen3NextConfig

    d = _doc(_write(tmp_path, Qwen3NextConfig()), "bf16")
    m = model_from_doc(d)
    assert d["layers"]["full_attention"] == 12 and d["layers"]["linear_attention"] == 36
    assert m.kv_shape_bytes_per_token == 12 * 2 * 256 * 2 * 2
    assert m.state_bytes_per_sequence > 0                              # fixed-size state per sequence
    assert any("linear-attention state" in a for a in d["assumptions"])


def test_config_without_a_shape_is_bad_input(cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    r = cli("plan", "--model", str(tmp_path), "--hardware", "h200", "--gpus", "1")
    assert r.exit_code == 2 and "num_hidden_layers" in r.stderr


def test_unknown_weight_format_is_bad_input(cli):
    r = cli("plan", "--model", LLAMA, "--weights", "q4_k_x")
    assert r.exit_code == 2 and "q4_k_m" in r.stderr


def test_kv_cache_dtype_changes_bytes_and_max_context():
    base = catalogue.get("model", "qwen3.8-27b-groupwise-int")
    m8, _ = plan_inputs.load_model("qwen3.8-27b-groupwise-int", None, None)
    m4, _ = plan_inputs.load_model("qwen3.8-27b-groupwise-int", None, "q4_0")
    assert m8.kv_bytes_per_element == base["kv_cache"]["bytes_per_element"] == 1
    assert m4.kv_bytes_per_element == KV_DTYPES["q4_0"].bytes_per_element == 18 / 32
    assert m8.kv_shape_bytes_per_token - m4.kv_shape_bytes_per_token == pytest.approx(16 * 4 * 256 * 2 * (1 - 18 / 32))


def test_kv_cache_dtype_on_the_cli_extends_the_4090_context(cli):
    args = ["plan", "--hardware", "rtx4090-24g", "--gpus", "1", "--model", "qwen3.8-27b-groupwise-int", "--context", "150K",
            "--engine", "llamacpp"]
    a = cli.json(*args)
    b = cli.json(*args, "--kv-cache-dtype", "q4_0")
    assert b["strategies"][0]["max_context"] > a["strategies"][0]["max_context"] * 1.3


def test_weights_reexpress_a_catalogue_model_and_say_so():
    m, _ = plan_inputs.load_model("qwen3.8-27b-nvfp4", "groupwise-int" if False else "q4_k_m", None)
    assert m.format == "q4_k_m"
    assert any("scaled by" in a for a in m.assumptions)
    own, _ = plan_inputs.load_model("qwen3.8-27b-nvfp4", None, None)
    assert m.weights_total_gb < own.weights_total_gb


@pytest.mark.parametrize("k, a, expected", [(0, 0.8, 1.0), (2, 0.75, 1 + 0.75 + 0.5625), (3, 1.0, 4.0), (4, 0.0, 1.0)])
def test_standard_speculation_formula(k, a, expected):
    assert tokens_per_round(k, a, "per_token") == pytest.approx(expected)


def test_speculation_with_a_draft_model_costs_its_steps(cli):
    """A separate draft model: k draft steps each read the draft's bytes and pay the round overhead."""
    base = ["plan", "--hardware", "rtx4090-24g", "--gpus", "1", "--model", LLAMA, "--weights", "q8_0", "--engine", "llamacpp",
            "--context", "4K"]
    plain = cli.json(*base)
    spec = cli.json(*base, "--draft-model", QWEN3, "--draft-tokens", "2", "--acceptance", "0.75")
    s0, s1 = plain["strategies"][0], spec["strategies"][0]
    d = s1["breakdown"]["decode"]
    assert d["tokens_per_round"] == pytest.approx(2.3125)
    assert d["draft_ms"] > 0 and s1["round_ms"] > s0["round_ms"] + d["draft_ms"] * 0.99
    assert s1["decode_tok_s"] < s0["decode_tok_s"] * 2.3125          # verification and drafting are not free
