"""What a config.json declares beyond a dense GQA shape: MLA, routed + shared experts, rope scaling, and the
refusals (exit 2, naming the field) for what the planner does not model.

Configs are written by transformers' own config classes (DeepSeek-V2/V3, Qwen3, Mistral) with the published
models' settings where the class defaults differ.
"""

from __future__ import annotations

import json

import pytest

from v100plan import catalogue, documents
from v100plan.planner import model_from_doc
from v100plan.planner.from_config import model_doc

# DeepSeek-V3 / R1's published config.json: yarn x40 over 4,096 (the class defaults carry the shape).
V3_ROPE = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
           "mscale": 1.0, "mscale_all_dim": 1.0}


def _write(tmp_path, cfg_obj, name="config.json") -> str:
    d = tmp_path / name.removesuffix(".json")
    d.mkdir()
    cfg_obj.to_json_file(str(d / "config.json"))
    return str(d)


def _raw(tmp_path, cfg: dict, name="m") -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _doc(path: str, fmt: str | None = None):
    cfg, src = catalogue.read_config(path)
    return documents.validate(model_doc(cfg, src, fmt), "model_profile")


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    from transformers import DeepseekV3Config

    tmp = tmp_path_factory.mktemp("dsv3")
    return _write(tmp, DeepseekV3Config(max_position_embeddings=163840, rope_scaling=V3_ROPE), "deepseek-v3")


def test_deepseek_v3_reads_mla_experts_and_yarn(v3):
    d = _doc(v3, "bf16")
    m = model_from_doc(d)
    assert d["parameters_b"] == pytest.approx(671, rel=0.01)             # 671 B without the MTP layer
    assert d["moe"]["experts"] == 256 and d["moe"]["active_experts"] == 8
    assert m.kv_latent_dim == 512 + 64 and m.kv_heads == 1               # the latent, one shared head
    assert m.kv_bytes_per_token == 61 * 576 * 2                          # 70,272 B, not 61 x 128 heads x 2 x 128 x 2
    assert m.native_context == 163840
    assert any("first 3 dense" in a for a in d["assumptions"])
    assert any("yarn" in a and "40" in a for a in d["assumptions"])


def test_deepseek_r1_awq_on_eight_h100_holds_a_shard_of_the_experts(cli, v3):
    """R1 (V3's shape) in 4-bit on 8 x H100: ~45 GB a card (the experts split eight ways), not a dense 4.5 GB."""
    p = cli.json("plan", "--model", v3, "--weights", "int4-awq", "--hardware", "h100-sxm", "--gpus", "8",
                 "--engine", "vllm", "--context", "32K")
    tp8 = next(s for s in p["strategies"] if s["name"] == "tp8")
    assert 43 < tp8["breakdown"]["memory"]["weights_gb"] < 48
    assert not next(s for s in p["strategies"] if s["name"] == "tp4")["fits"]


def test_deepseek_v2_lite_without_a_query_latent(tmp_path):
    from transformers import DeepseekV2Config

    cfg = DeepseekV2Config(hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
                           q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                           n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
                           intermediate_size=10944, first_k_dense_replace=1, vocab_size=102400,
                           max_position_embeddings=163840)
    d = _doc(_write(tmp_path, cfg), "bf16")
    assert d["parameters_b"] == pytest.approx(15.7, rel=0.02)             # DeepSeek-V2-Lite: 15.7 B total
    assert d["matrix_flops_per_token"] / 2e9 == pytest.approx(2.4, rel=0.06)   # 2.4 B activated
    assert model_from_doc(d).kv_bytes_per_token == 27 * 576 * 2


@pytest.mark.parametrize("rope, mpe, expected", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 32768, 131072),   # Qwen3's long-context recipe
    ({"rope_type": "dynamic", "factor": 2.0}, 32768, 65536),
    ({"type": "longrope", "short_factor": [1.0], "long_factor": [1.0], "original_max_position_embeddings": 4096}, 131072, 131072),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 131072, 131072),
    ({"rope_type": "linear", "factor": 4.0}, 16384, 16384),
])
def test_rope_scaling_sets_the_native_context(tmp_path, rope, mpe, expected):
    cfg = json.loads(open("engine/data/qwen3-8b.config.json").read())
    cfg.update(rope_scaling=rope, max_position_embeddings=mpe)
    assert model_from_doc(_doc(_raw(tmp_path, cfg))).native_context == expected


def test_yarn_context_past_max_position_embeddings_is_planned(cli, tmp_path):
    cfg = json.loads(open("engine/data/qwen3-8b.config.json").read())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 40960}
    p = cli.json("plan", "--model", _raw(tmp_path, cfg), "--hardware", "h200", "--gpus", "1", "--context", "128K")
    assert p["strategies"][0]["fits"]


def _qwen3(**extra) -> dict:
    cfg = json.loads(open("engine/data/qwen3-8b.config.json").read())
    cfg.update(extra)
    return cfg


@pytest.mark.parametrize("extra, field", [
    ({"rope_scaling": {"rope_type": "su-scaled", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"layer_types": ["chunked_attention", "full_attention"] * 18}, "layer_types"),
    ({"attention_chunk_size": 8192}, "attention_chunk_size"),
    ({"num_experts": 64, "num_experts_per_tok": 4, "moe_intermediate_size": 768, "decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"n_routed_experts": 64, "num_experts_per_tok": 6, "moe_layer_freq": 2}, "moe_layer_freq"),
    ({"kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_topk": 2048}, "index_topk"),
])
def test_what_the_planner_does_not_model_is_refused_by_name(cli, tmp_path, extra, field):
    r = cli("plan", "--model", _raw(tmp_path, _qwen3(**extra)), "--hardware", "h200", "--gpus", "1")
    assert r.exit_code == 2, r.stderr
    assert field in r.stderr and "Traceback" not in r.stderr


def test_mistral_v01_is_planned_with_its_window_capping_the_kv(cli, tmp_path):
    """Mistral 7B v0.1: a 4,096-token window on every layer. Under the window it is plain attention; beyond it the
    cache stops growing. Published check (Mistral 7B paper, Jiang et al. 2023, section 2): "for a sequence length of
    32k tokens, this reduces the cache memory usage by 8x"."""
    from transformers import MistralConfig

    path = _write(tmp_path, MistralConfig(sliding_window=4096, max_position_embeddings=32768))
    doc = _doc(path, "fp16")
    assert doc["attention"]["sliding_window"] == 4096 and doc["attention"]["sliding_layers"] == 32
    m = model_from_doc(doc)
    assert m.kv_bytes_at(32768) * 8 == pytest.approx(m.kv_bytes_per_token * 32768)      # the paper's 8x
    assert m.kv_bytes_at(2048) == pytest.approx(m.kv_bytes_per_token * 2048)            # under the window: as before
    p = cli.json("plan", "--model", path, "--hardware", "rtx4090-24g", "--gpus", "1", "--context", "32K",
                 "--weights", "fp16", "--engine", "llamacpp")
    s = p["strategies"][0]
    assert s["fits"] and s["max_context"] == 32768                                      # capped K/V: the native limit
    assert s["breakdown"]["decode"]["kv_read_gb"] == pytest.approx(m.kv_bytes_at(32768) / 1e9, abs=1e-3)
    assert any("sliding window 4,096 tokens on 32 of 32" in n for n in p["notes"])


def test_mixed_sliding_and_full_layers_cap_only_the_sliding_ones(tmp_path):
    cfg = _qwen3(sliding_window=1024, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 12)
    m = model_from_doc(_doc(_raw(tmp_path, cfg)))
    assert m.window_layers == 24 and m.attention_layers == 36
    per_layer = m.kv_shape_bytes_per_token / 36
    assert m.kv_bytes_at(8192) == pytest.approx(per_layer * (12 * 8192 + 24 * 1024))


def test_a_window_no_shorter_than_the_context_or_switched_off_is_read(tmp_path):
    """Qwen2.5 ships sliding_window with use_sliding_window false; a window as long as the context changes nothing."""
    off = _doc(_raw(tmp_path, _qwen3(sliding_window=4096, use_sliding_window=False), "off"))
    whole = _doc(_raw(tmp_path, _qwen3(sliding_window=40960, use_sliding_window=True), "whole"))
    assert off["native_context"] == whole["native_context"] == 40960


def test_the_hybrid_profiles_compute_their_gdn_state_from_the_shape():
    """The catalogue's 27B hybrid: 48 linear layers x (48 x 128 x 128 x 4 B recurrent state + (2 x 16 x 128 + 48 x 128)
    channels x 3 x 2 B conv window) = 153.9 MB a sequence, computed from the profile's linear_attention fields (the
    engine keeps the same buffers), and the same formula reads a Qwen3-Next config.json."""
    from transformers import Qwen3NextConfig

    for mid in ("qwen3.8-27b-nvfp4", "qwen3.8-27b-groupwise-int"):
        doc = catalogue.get("model", mid)
        m = model_from_doc(doc)
        assert doc["hidden_size"] == 5120 and doc["linear_attention"]["value_heads"] == 48
        assert m.state_bytes_per_sequence == 48 * (48 * 128 * 128 * 4 + (2 * 16 * 128 + 48 * 128) * 3 * 2)
        assert m.state_bytes_per_sequence / 1e6 == pytest.approx(153.9, abs=0.05)
    shaped = dict(linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, num_hidden_layers=64, full_attention_interval=4, hidden_size=5120,
                  num_attention_heads=24, num_key_value_heads=4, head_dim=256, intermediate_size=17408, vocab_size=248320)
    cfg = {k: v for k, v in Qwen3NextConfig(**shaped).to_dict().items()}
    cfg.update(num_experts=0, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        derived = model_from_doc(_doc(d))
    assert derived.state_bytes_per_sequence == m.state_bytes_per_sequence
    assert derived.attention_layers == 16


def test_a_plan_holds_the_gdn_state_per_sequence(cli):
    # vLLM: an engine that batches (the bundled one decodes one sequence at a time, below)
    one = cli.json("plan", "--hardware", "v100-sxm2-32gb", "--gpus", "1", "--model", "qwen3.8-27b-groupwise-int",
                   "--context", "8K", "--concurrency", "1", "--engine", "vllm")
    two = cli.json("plan", "--hardware", "v100-sxm2-32gb", "--gpus", "1", "--model", "qwen3.8-27b-groupwise-int",
                   "--context", "8K", "--concurrency", "2", "--engine", "vllm")
    k1 = one["strategies"][0]["breakdown"]["memory"]["kv_gb"]
    k2 = two["strategies"][0]["breakdown"]["memory"]["kv_gb"]
    assert k2 - k1 == pytest.approx(8192 * 45573 / 1e9 + 0.154, abs=0.002)


def test_each_strategy_says_how_many_sequences_its_cards_hold_and_that_many_fit(cli):
    """sequences_that_fit is the memory model's own answer: planning that many concurrent sequences fits, one
    more runs out of memory (vLLM: an engine that batches)."""
    base = ("plan", "--hardware", "v100-sxm2-32gb", "--model", "qwen3.5-27b", "--context", "64K", "--engine", "vllm")
    tp2 = next(s for s in cli.json(*base)["strategies"] if s["name"] == "tp2")
    n = tp2["breakdown"]["memory"]["sequences_that_fit"]
    assert n >= 2
    at_n = next(s for s in cli.json(*base, "--concurrency", str(n))["strategies"] if s["name"] == "tp2")
    assert at_n["fits"]
    r = cli(*base, "--concurrency", str(n + 1), "--json")
    over = next(s for s in json.loads(r.stdout)["strategies"] if s["name"] == "tp2")
    assert not over["fits"] and "per GPU" in over["reason"]


def test_the_bundled_engine_is_planned_to_batch_what_it_now_serves_together(cli):
    """serve --max-concurrency decodes up to 64 sequences in one batched step: four concurrent requests plan (no
    'would queue' refusal), each at the one-sequence round's speed over the measured step ratio (more in
    test_planner_batched_step.py); 65 are past what the service takes and refused."""
    base = ("plan", "--hardware", "h200", "--gpus", "1", "--engine", "v100plan", "--weights", "int4-gptq", "--context", "4K",
            "--draft-tokens", "0")
    one = next(s for s in cli.json(*base, "--concurrency", "1")["strategies"] if s["name"] == "single")
    four = next(s for s in cli.json(*base, "--concurrency", "4")["strategies"] if s["name"] == "single")
    assert four["fits"] and "would queue" not in four["reason"]
    assert four["decode_tok_s"] == pytest.approx(one["decode_tok_s"] / (43.26 / 8.37), rel=1e-3)  # int4 4K, C = 4
    assert four["aggregate_tok_s"] == pytest.approx(4 * four["decode_tok_s"], rel=1e-3)
    r = cli(*base, "--concurrency", "65", "--json")
    assert r.exit_code == 1
    assert all("decodes at most 64 sequence(s) at once: 65 concurrent requests would queue" in s["reason"]
               for s in json.loads(r.stdout)["strategies"])


@pytest.mark.parametrize("card, bw, gib, cc, bf16", [
    ("a100-pcie-40gb", 1555, 40, "8.0", True), ("a100-pcie-80gb", 1935, 80, "8.0", True), ("h100-pcie", 2000, 80, "9.0", True),
    ("h20", 4000, 96, "9.0", True), ("l40s", 864, 48, "8.9", True), ("rtx3090", 936, 24, "8.6", True),
    ("tesla-p40", 346, 24, "6.1", False), ("tesla-p100-16gb", 732, 16, "6.0", False),
])
def test_the_cards_people_buy_are_catalogued_with_their_nominal_figures(cli, card, bw, gib, cc, bf16):
    d = catalogue.get("hardware", card)
    assert (d["mem_bw_nominal_gbps"], d["memory_gib"], d["compute_capability"], d["native_bf16"]) == (bw, gib, cc, bf16)
    assert d["sources"]["mem_bw_nominal_gbps"] and d["sources"]["pci_device_ids"]
    # the memory clock is the bandwidth's arithmetic, clock x 2 x bus / 8
    assert d["mem_clock_max_mhz"] * 2 * d["bus_width_bits"] / 8 / 1e3 == pytest.approx(bw, rel=1e-3)
    p = cli.json("plan", "--hardware", card, "--gpus", "1", "--model", "engine/data/llama-3.1-8b.config.json",
                 "--weights", "q4_k_m", "--engine", "llamacpp", "--context", "4K")
    dec = p["strategies"][0]["breakdown"]["decode"]
    assert p["strategies"][0]["decode_ceiling_tok_s"] == pytest.approx(bw / (dec["weights_read_gb"] + dec["kv_read_gb"]), rel=0.01)
    assert p["launch"]["dtype"] == ("bfloat16" if bf16 else "float16")


@pytest.mark.parametrize("extra, fmt, dtype", [
    ({"torch_dtype": "float16"}, "fp16", "float16"),
    ({"torch_dtype": None, "dtype": "bfloat16"}, "bf16", "bfloat16"),          # transformers 5 names it `dtype`
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}, "int4-gptq", "float16"),
])
def test_a_config_without_weights_is_read_in_its_own_format(cli, tmp_path, extra, fmt, dtype):
    """No --weights: the checkpoint's own dtype (or its 4-bit quantization) is the file's format, and the launch
    runs it in that dtype on a card with bf16 too (an fp16 file is not launched as bfloat16)."""
    path = _raw(tmp_path, _qwen3(**extra))
    doc = cli.json("plan", "--model", path, "--hardware", "h100-sxm", "--gpus", "1", "--engine", "vllm", "--context", "4K")
    assert doc["launch"]["dtype"] == dtype
    assert model_from_doc(_doc(path)).format == fmt
