"""Qwen3-Next (qwen3_next: the Gated DeltaNet / gated attention hybrid with sparse MoE MLPs) judged against
transformers' (5.24 and later; CI installs 5.25) Qwen3NextForCausalLM on the same random weights, at TP1 and TP2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.core import config as ecfg
from engine.core import moe, qwen3_next, runner, shard, tp, weights
from engine.core.model import Model
from engine.core.sampling import Sampler
from tests.engine_helpers import REPO, eager_and_static_step, spread_hybrid_weights

# Small, with the real model's ratios where they matter: 3 value heads per key head (the interleaved qkvz
# layout is then not the identity), 2 of 8 experts per token, one dense layer among MoE ones (mlp_only_layers).
SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=6,
             linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
             max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, num_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
             mlp_only_layers=[2])
PROMPT = [1, 17, 300, 42, 5, 99, 7, 250, 11]
N_TOKENS = 32


def checkpoint(d):
    """transformers' random model saved in d, and its 32 greedy tokens after PROMPT."""
    import transformers

    torch.manual_seed(4321)
    hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**SMALL)).eval()
    spread_hybrid_weights(hf)
    with torch.no_grad():
        hf.save_pretrained(d, safe_serialization=True)
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS,
                          do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
    return hf, ref


@pytest.fixture(scope="module")
def nxt(tmp_path_factory):
    """(transformers' model, the engine's model of its checkpoint, the checkpoint, its 32 greedy tokens)."""
    d = tmp_path_factory.mktemp("qwen3_next")
    hf, ref = checkpoint(d)
    m = Model(ecfg.load(d))
    weights.load_into(m, d)
    m.setup_cache(256)
    return hf, m, d, ref


def test_the_mlp_table_and_the_expert_tensors_come_from_the_config(nxt):
    _, m, _, _ = nxt
    assert m.cfg.model_type == "qwen3_next" and m.cfg.mtp_layers == 0
    assert m.cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert m.cfg.mlp_types == ("moe", "moe", "dense", "moe")  # layer 2 is in mlp_only_layers
    la = m.layers[0].mlp
    assert la.router.shape == (8, 128) and la.shared_gate.shape == (1, 128)
    assert la.ew13.shape == (8, 128, 128) and la.ew2.shape == (8, 128, 64)
    assert la.w13.shape == (192, 128) and la.w2.shape == (128, 96)  # the shared expert
    assert m.layers[2].mlp.w13.shape == (512, 128) and not hasattr(m.layers[2].mlp, "ew13")
    assert m.cfg.param_count() == sum(p.numel() for p in nxt[0].parameters())


def test_logits_at_every_position_of_100_tokens_with_chunk_boundaries_inside(nxt):
    hf, m, _, _ = nxt
    ids = torch.randint(0, 512, (1, 100), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids, use_cache=False).logits[0]
    bounds = [0, 37, 100]  # a chunk of 63 after one of 37: a boundary inside the gated delta rule's chunks
    got = torch.cat([m.forward(ids[:, a:b], a, all_logits=True) for a, b in zip(bounds, bounds[1:])])
    err = (got - ref).abs().max().item()
    assert err < 1e-4 * ref.abs().max().item(), f"max |diff| {err} of {ref.abs().max().item()}"


def test_greedy_tokens_identical_to_transformers(nxt):
    _, m, _, ref = nxt
    out, reason = runner.run(m, PROMPT, N_TOKENS, Sampler(), set(), chunk=4)
    assert reason == "length"
    assert out == ref, f"first difference at {next(i for i, (a, b) in enumerate(zip(out, ref)) if a != b)}"


def test_the_decode_steps_moe_equals_the_prefills(nxt):
    _, m, d, _ = nxt
    eager, static, _ = eager_and_static_step(m, d, torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32]]), 128)
    assert (eager - static).abs().max().item() < 1e-5
    # one layer's MLP directly: the gathered-experts form against the per-expert loop
    la = m.layers[0].mlp
    h = torch.randn(1, 1, 128, generator=torch.Generator().manual_seed(9))
    routed = moe.decode(h, la.router, la.shared_gate, la.ew13, la.ew2, k=2, norm_topk=True)
    loop = moe.prefill(h, la.router, la.shared_gate, la.ew13, la.ew2, la.w13, la.w2, k=2, norm_topk=True,
                       shared=lambda x, w13, w2: torch.zeros_like(x))
    assert (routed - loop).abs().max().item() < 1e-6 and routed.abs().max().item() > 1e-3


def test_a_ranks_slice_of_the_fused_projections_converts_to_its_part_of_the_engines_layout(nxt):
    """TP2 takes whole key-head groups of in_proj_qkvz / in_proj_ba (colwise); converted with the rank's head
    counts they must be exactly what the Qwen3.5 split (colwise_qkv, colwise) gives of the converted whole."""
    from safetensors.torch import load_file

    _, m, d, _ = nxt
    full = load_file(str(d / "model.safetensors"))
    qkvz, ba = full["model.layers.0.linear_attn.in_proj_qkvz.weight"], full["model.layers.0.linear_attn.in_proj_ba.weight"]
    assert tp.kind_of("model.layers.0.linear_attn.in_proj_qkvz.weight") == "colwise"
    qkv, z = qwen3_next.split_qkvz(qkvz, 2, 6, 32, 32)
    b, a = qwen3_next.split_ba(ba, 2, 6)
    assert not torch.equal(qkv[:64], qkvz[:64]) or not torch.equal(z, qkvz[-192:])  # not the identity
    for r in range(2):
        rq, rz = qwen3_next.split_qkvz(tp.take(qkvz, "colwise", r, 2), 1, 3, 32, 32)
        rb, ra = qwen3_next.split_ba(tp.take(ba, "colwise", r, 2), 1, 3)
        assert torch.equal(rq, tp.take(qkv, "colwise_qkv", r, 2, m.cfg))
        assert torch.equal(rz, tp.take(z, "colwise", r, 2)) and torch.equal(rb, tp.take(b, "colwise", r, 2))
        assert torch.equal(ra, tp.take(a, "colwise", r, 2))


def test_the_shard_tool_splits_every_expert_and_replicates_the_router(tmp_path, nxt):
    _, _, d, _ = nxt
    kinds = shard.shard(d, tmp_path / "s", 2)["tensors"]  # reassembled bit-exactly, or it raises
    p = "model.layers.0.mlp."
    assert kinds[p + "experts.7.gate_proj.weight"] == kinds[p + "experts.0.up_proj.weight"] == "colwise"
    assert kinds[p + "experts.3.down_proj.weight"] == kinds[p + "shared_expert.down_proj.weight"] == "rowwise"
    assert kinds[p + "gate.weight"] == kinds[p + "shared_expert_gate.weight"] == "replicated"
    assert kinds["model.layers.0.linear_attn.in_proj_ba.weight"] == "colwise"


def test_tp2_greedy_tokens_equal_transformers_through_generate(nxt):
    _, _, d, ref = nxt
    proc = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(d), "--tp", "2",
                           "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", str(N_TOKENS), "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"] == ref


@pytest.mark.parametrize("bad,match", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok = 9 must be between 1 and num_experts = 8"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step = 0"),
    ({"mlp_only_layers": [4]}, "mlp_only_layers"),
    ({"moe_intermediate_size": None}, "lacks 'moe_intermediate_size'"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size = 0"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}, "quantization_config"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_configs_the_engine_cannot_run_are_refused_naming_the_field(bad, match):
    with pytest.raises(ecfg.ConfigError, match=match):
        ecfg.from_dict(dict(SMALL, model_type="qwen3_next", **bad))


def test_expert_widths_that_do_not_split_are_refused_naming_the_field():
    cfg = ecfg.from_dict(dict(SMALL, model_type="qwen3_next", moe_intermediate_size=63))
    with pytest.raises(tp.ShardError, match="moe_intermediate_size = 63 is not divisible by 2"):
        tp.check_divisible(cfg, 2)


def test_the_sparse_step_builds_the_mlp_table():
    cfg = ecfg.from_dict(dict(SMALL, model_type="qwen3_next", decoder_sparse_step=2, mlp_only_layers=[]))
    assert cfg.mlp_types == ("dense", "moe", "dense", "moe")
    dense = ecfg.from_dict(dict(SMALL, model_type="qwen3_next", num_experts=0))
    assert not dense.moe and dense.mlp_types == ("dense",) * 4


def test_a_random_weights_model_of_the_shape_loads_every_expert(tmp_path, nxt):
    from engine.core import random_weights

    hf, m, _, _ = nxt
    raw = json.loads((nxt[2] / "config.json").read_text())
    summary = random_weights.write(tmp_path / "r", raw, seed=1)
    assert summary["parameters"] == sum(p.numel() for p in hf.parameters())
    r = Model(ecfg.load(tmp_path / "r"))
    weights.load_into(r, tmp_path / "r")  # WeightsError if any expert, router or shared-expert tensor is unfilled
    assert r.weights_origin == "random" and r.layers[3].mlp.ew2.abs().sum() > 0
    sparse = r.weight_bytes()  # a step reads the 2 chosen experts of 8
    moe_layers = [la.mlp for la in r.layers if la.mlp.kind == "moe"]
    for la in moe_layers:
        la.top_k = 8
    try:
        every = r.weight_bytes()
    finally:
        for la in moe_layers:
            la.top_k = 2
    assert every - sparse == sum((la.ew13.numel() + la.ew2.numel()) * 4 * 6 // 8 for la in moe_layers)


@pytest.mark.parametrize("norm_topk", [True, False])
def test_the_moe_forms_equal_transformers_sparse_block(norm_topk):
    """engine.core.moe's prefill and decode forms against transformers' Qwen3NextSparseMoeBlock on 20 tokens."""
    import transformers
    from transformers.models.qwen3_next import modeling_qwen3_next as hfm

    cfg = transformers.Qwen3NextConfig(**dict(SMALL, norm_topk_prob=norm_topk))
    torch.manual_seed(7)
    block = hfm.Qwen3NextSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
        h = torch.randn(1, 20, 128)
        want = block(h)
    w13 = torch.cat([block.shared_expert.gate_proj.weight, block.shared_expert.up_proj.weight])
    w2 = block.shared_expert.down_proj.weight

    def shared(x, w13, w2):
        gate, up = torch.nn.functional.linear(x, w13).chunk(2, dim=-1)
        return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2)

    args = (block.gate.weight, block.shared_expert_gate.weight, block.experts.gate_up_proj, block.experts.down_proj)
    with torch.no_grad():
        got = moe.prefill(h, *args, w13, w2, k=2, norm_topk=norm_topk, shared=shared)
        steps = torch.cat([moe.decode(h[:, i:i + 1], *args, k=2, norm_topk=norm_topk)
                           + moe.gate_scale(h[:, i:i + 1], args[1]) * shared(h[:, i:i + 1], w13, w2)
                           for i in range(20)], dim=1)
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item() * 10
    assert (steps - want).abs().max().item() < 1e-5 * want.abs().max().item() * 10
