"""The hybrid class (Qwen3.5: Gated DeltaNet linear-attention layers between gated full-attention layers)
judged against transformers' (5.24 and later; CI installs 5.25) Qwen3_5ForCausalLM on the same random weights, at TP1 and TP2."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from engine.core import config as ecfg
from engine.core import runner, shard, tp, weights
from engine.core.model import Model
from engine.core.sampling import Sampler
from engine.kernels import gdn
from tests.engine_helpers import (
    REPO,
    eager_and_static_step,
    interpreter_spec,
    run_interpreter_cases,
    spread_hybrid_weights,
)

# The 27B shape's ratios, shrunk: every 4th layer full attention, 6:1... here 2:1 GQA, head dim 64 with a
# quarter rotary, each linear-attention key head serving 3 value heads (as 16 key / 48 value heads do).
SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=6,
             linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
             max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


def _hf(out, multimodal: bool = False):
    import transformers

    torch.manual_seed(4321)
    text = transformers.Qwen3_5TextConfig(**SMALL)
    model = transformers.Qwen3_5ForCausalLM(text).eval()
    spread_hybrid_weights(model)
    if not multimodal:
        model.save_pretrained(out, safe_serialization=True)
        return model
    cfg = transformers.Qwen3_5Config(text_config=text.to_dict(),
                                     vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                                        out_hidden_size=SMALL["hidden_size"]))
    mm = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    mm.model.language_model.load_state_dict(model.model.state_dict())
    mm.lm_head.load_state_dict(model.lm_head.state_dict())
    mm.save_pretrained(out, safe_serialization=True)
    return model


def _greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of exactly n tokens."""
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_5")
    hf = _hf(d)
    m = Model(ecfg.load(d))
    weights.load_into(m, d)
    m.setup_cache(512)
    return hf, m, d


def test_layer_table_comes_from_the_config(hybrid):
    _, m, _ = hybrid
    assert m.cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert [la.kind for la in m.layers] == list(m.cfg.layer_types)
    assert m.cfg.rotary_dim == 16 and m.cfg.attn_output_gate and m.cfg.zero_centred_norm
    lin = m.layers[0]
    assert lin.rec_state.shape == (6, 32, 32) and lin.rec_state.dtype == torch.float32
    assert lin.conv_ring.shape == (2 * 64 + 192, 4)
    # K/V only where attention is full; a fixed state elsewhere
    assert m.state_bytes()["kv_cache"] == 2 * 512 * 2 * 64 * 4
    # three linear-attention layers: float32 state [6, 32, 32] and a conv ring of 4 slots x 320 channels
    assert m.state_bytes()["linear_state"] == 3 * (6 * 32 * 32 * 4 + 320 * 4 * 4)


def test_logits_at_every_position_of_200_tokens_with_chunk_boundaries_inside(hybrid):
    hf, m, _ = hybrid
    ids = torch.randint(0, 512, (1, 200), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids, use_cache=False).logits[0]
    bounds = [0, 37, 101, 165, 200]  # chunks of 37 and 64: boundaries inside the gated delta rule's chunks
    got = torch.cat([m.forward(ids[:, a:b], a, all_logits=True) for a, b in zip(bounds, bounds[1:])])
    err = (got - ref).abs().max().item()
    assert err < 1e-5 * ref.abs().max().item() * 10, f"max |diff| {err} of {ref.abs().max().item()}"


def test_greedy_64_tokens_identical_to_transformers(hybrid):
    hf, m, _ = hybrid
    prompt = [1, 17, 300, 42, 5, 99, 7, 250, 11]
    ref = _greedy(hf, prompt, 64)
    out, reason = runner.run(m, prompt, 64, Sampler(), set(), chunk=4)
    assert reason == "length"
    assert out == ref, f"first difference at {next(i for i, (a, b) in enumerate(zip(out, ref)) if a != b)}"


def test_static_decode_step_equals_prefill_of_the_same_token(hybrid):
    _, m, d = hybrid
    eager, static, m2 = eager_and_static_step(m, d, torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32]]), 256)
    assert (eager - static).abs().max().item() < 1e-5
    # the recurrent and conv states after both paths agree too
    for a, b in zip(m.layers[:3], m2.layers[:3]):
        assert torch.allclose(a.rec_state, b.rec_state, atol=1e-6)
        assert torch.allclose(a.conv_ring, b.conv_ring, atol=1e-6)


def test_a_new_sequence_resets_the_linear_attention_state(hybrid):
    _, m, _ = hybrid
    a = [5, 6, 7, 8, 9]
    first = m.forward(torch.tensor([a]), 0)
    m.forward(torch.tensor([[100, 200, 300, 400, 1, 2, 3]]), 0)  # another request in between
    again = m.forward(torch.tensor([a]), 0)
    assert torch.equal(first, again)


def test_gated_delta_rule_forms_agree_and_match_transformers():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hfm

    g = torch.Generator().manual_seed(1)
    t, hk, hv, dk, dv = 150, 2, 6, 16, 24
    q, k = torch.randn(t, hk, dk, generator=g), torch.randn(t, hk, dk, generator=g)
    v = torch.randn(t, hv, dv, generator=g)
    decay, beta = -torch.rand(t, hv, generator=g), torch.rand(t, hv, generator=g)
    s0 = torch.randn(hv, dk, dv, generator=g) * 0.1
    o_ref, s_ref = gdn.recurrent(q, k, v, decay, beta, s0)
    o_chunk, s_chunk = gdn.chunked(q, k, v, decay, beta, s0)
    o_hf, s_hf = hfm.torch_recurrent_gated_delta_rule(q[None], k[None], v[None], decay[None], beta[None],
                                                      initial_state=s0[None], output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
    assert (o_chunk - o_ref).abs().max() < 1e-4 and (s_chunk - s_ref).abs().max() < 1e-4
    assert (o_ref - o_hf[0]).abs().max() < 1e-5 and (s_ref - s_hf[0]).abs().max() < 1e-5
    state = s0.clone()
    steps = torch.stack([gdn.step(q[i], k[i], v[i], decay[i], beta[i], state) for i in range(t)])
    assert (steps - o_ref).abs().max() < 1e-5 and (state - s_ref).abs().max() < 1e-5


def test_multimodal_wrapper_layout_loads_the_same_weights(tmp_path, hybrid):
    hf, m, _ = hybrid
    d = tmp_path / "mm"
    _hf(d, multimodal=True)
    raw = json.loads((d / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5" and "text_config" in raw
    cfg = ecfg.load(d)
    assert cfg.weight_prefix == "model.language_model."
    mm = Model(cfg)
    weights.load_into(mm, d)  # vision tensors are ignored, text tensors found under the wrapper's prefix
    mm.setup_cache(512)
    prompt = [1, 33, 44, 55, 66]
    a, _ = runner.run(m, prompt, 16, Sampler(), set(), chunk=8)
    b, _ = runner.run(mm, prompt, 16, Sampler(), set(), chunk=8)
    assert a == b


def test_tp2_splits_linear_attention_heads_and_reassembles(tmp_path, hybrid):
    _, m, d = hybrid
    manifest = shard.shard(d, tmp_path / "s", 2)
    kinds = manifest["tensors"]
    assert kinds["model.layers.0.linear_attn.in_proj_qkv.weight"] == "colwise_qkv"
    assert kinds["model.layers.0.linear_attn.conv1d.weight"] == "colwise_qkv"
    assert kinds["model.layers.0.linear_attn.out_proj.weight"] == "rowwise"
    assert kinds["model.layers.0.linear_attn.A_log"] == "colwise"
    # rank 0's in_proj_qkv rows are [its q heads | its k heads | its v heads]
    from safetensors.torch import load_file

    full = load_file(str(d / "model.safetensors"))["model.layers.0.linear_attn.in_proj_qkv.weight"]
    r0 = load_file(str(tmp_path / "s" / "rank0" / "model.safetensors"))["model.layers.0.linear_attn.in_proj_qkv.weight"]
    kd, vd = 64, 192
    assert torch.equal(r0, torch.cat([full[:kd // 2], full[kd:kd + kd // 2], full[2 * kd:2 * kd + vd // 2]]))


def test_heads_that_do_not_split_are_refused_naming_the_field():
    raw = dict(SMALL, model_type="qwen3_5_text", linear_num_key_heads=1, linear_num_value_heads=3)
    cfg = ecfg.from_dict(raw)
    with pytest.raises(tp.ShardError, match="linear_num_key_heads = 1 is not divisible by 2"):
        tp.check_divisible(cfg, 2)


@pytest.mark.parametrize("bad,match", [
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
     "sliding_attention"),
    ({"layer_types": ["linear_attention"]}, "lists 1 layers"),
    ({"linear_num_value_heads": 5}, "not a multiple of linear_num_key_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_configs_the_engine_cannot_run_are_refused(bad, match):
    with pytest.raises(ecfg.ConfigError, match=match):
        ecfg.from_dict(dict(SMALL, model_type="qwen3_5_text", **bad))


def test_full_attention_interval_builds_the_layer_table():
    raw = dict(SMALL, model_type="qwen3_5_text", num_hidden_layers=8, full_attention_interval=4)
    cfg = ecfg.from_dict(raw)
    assert cfg.layer_types.count("full_attention") == 2 and cfg.layer_types[3] == "full_attention"


def test_the_real_27b_shape_ships_consistent_with_the_field_report():
    from engine import DATA_DIR

    cfg = ecfg.load_file(DATA_DIR / "qwen3.5-27b.config.json")
    assert cfg.num_layers == 64 and cfg.n_full == 16 and cfg.n_linear == 48
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size) == (24, 4, 256, 5120)
    assert cfg.kv_bytes_per_token(1) == 32 * 1024  # the report's int8 K/V: 32 KiB per token
    assert abs(cfg.param_count() / 1e9 - 26.9) < 0.05
    tp.check_divisible(cfg, 2)


def test_tp2_greedy_tokens_equal_transformers_through_generate(hybrid):
    hf, _, d = hybrid
    prompt = [1, 17, 300, 42, 5, 99, 7, 250, 11]
    ref = _greedy(hf, prompt, 64)
    proc = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(d), "--tp", "2",
                           "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "64", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"] == ref


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Triton is not installed: the fused kernels cannot run (pip install triton)")
@pytest.mark.early(interpreter_spec("tests/engine_hybrid_cases.py"))
def test_fused_hybrid_kernels_match_the_plain_blocks_under_the_triton_interpreter():
    run_interpreter_cases("tests/engine_hybrid_cases.py", 17)


def test_the_served_tp2_answer_equals_transformers_and_images_are_refused(hybrid):
    from tests.test_service_support import ServiceProcess

    hf, _, d = hybrid
    prompt = [1, 17, 300, 42, 5, 99, 7, 250, 11]
    ref = _greedy(hf, prompt, 48)
    svc = ServiceProcess(model=str(d))
    try:
        svc.wait_healthy()
        model_id = svc.client.get("/v1/models").json()["data"][0]["id"]
        r = svc.client.post("/v1/completions", json={"model": model_id, "prompt": prompt, "max_tokens": 48,
                                                     "temperature": 0.0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["v100plan"]["token_ids"] == ref
        img = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        r = svc.client.post("/v1/chat/completions", json={"model": model_id, "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, img]}]})
        assert r.status_code == 400 and "image_url input is not served" in r.json()["error"]["message"]
    finally:
        svc.stop()
