"""The engine's decoder judged against Hugging Face transformers on the same random weights."""

from __future__ import annotations

import json

import pytest
import torch

from engine.core import config as ecfg
from engine.core import runner, weights
from engine.core.model import Model
from engine.core.sampling import Sampler
from tests.engine_helpers import SHRINK, eager_and_static_step, make_hf_model, small_config


@pytest.fixture(scope="module", params=sorted(SHRINK))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, d)
    cfg = ecfg.load(d)
    m = Model(cfg)
    weights.load_into(m, d)
    m.setup_cache(256)
    return request.param, hf, m, d


def test_logits_match_transformers_with_chunked_prefill(pair):
    name, hf, m, _ = pair
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [T, V]
    got = torch.cat([m.forward(ids[:, :13], 0, all_logits=True), m.forward(ids[:, 13:], 13, all_logits=True)])
    assert got.shape == ref.shape
    err = (got - ref).abs().max().item()
    assert err < 1e-4 * ref.abs().max().item(), f"{name}: max |diff| {err}"


def test_greedy_64_tokens_identical_to_transformers(pair):
    name, hf, m, _ = pair
    prompt = [1, 17, 300, 42, 5, 99]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
    out, reason = runner.run(m, prompt, 64, Sampler(), set(), chunk=4)
    assert reason == "length"
    assert out == ref, f"{name}: first difference at {next(i for i, (a, b) in enumerate(zip(out, ref)) if a != b)}"


def test_static_decode_step_matches_eager(pair):
    _, _, m, d = pair
    eager, static, _ = eager_and_static_step(m, d, torch.tensor([[3, 14, 15, 92, 65, 35, 89]]), 256)
    assert (eager - static).abs().max().item() < 1e-4


def test_shapes_come_from_config_json():
    cfg = ecfg.from_dict(small_config("qwen3-8b"))
    assert cfg.head_dim == 48 and cfg.hidden_size // cfg.num_heads == 32  # head_dim is not hidden / heads
    assert cfg.qk_norm and not cfg.attention_bias
    q2 = ecfg.from_dict(small_config("qwen2.5-0.5b"))
    assert q2.attention_bias and not q2.o_bias and q2.tie_word_embeddings
    llama = ecfg.from_dict(small_config("llama-3.1-8b"))
    assert llama.rope_scaling["rope_type"] == "llama3"


def test_transformers_5_rope_parameters_are_read(tmp_path):
    raw = small_config("llama-3.1-8b")
    raw["rope_parameters"] = dict(raw.pop("rope_scaling"), rope_theta=raw.pop("rope_theta"))
    cfg = ecfg.from_dict(raw)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["factor"] == 8.0


@pytest.mark.parametrize("change,expect", [
    ({"model_type": "mixtral"}, "model_type 'mixtral' is not supported"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_scaling type 'longrope' is not supported"),
])
def test_unsupported_configs_are_refused_with_the_reason(change, expect):
    raw = small_config("llama-3.1-8b")
    raw.update(change)
    with pytest.raises(ecfg.ConfigError, match=expect):
        ecfg.from_dict(raw)


def test_missing_tensor_is_named(tmp_path, pair):
    from safetensors.torch import load_file, save_file

    _, _, _, d = pair
    sd = load_file(str(d / "model.safetensors"))
    sd.pop("model.layers.1.mlp.down_proj.weight")
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    save_file(sd, str(tmp_path / "model.safetensors"))
    m = Model(ecfg.load(tmp_path))
    with pytest.raises(weights.WeightsError, match="layers.1.w2"):
        weights.load_into(m, tmp_path)


def test_sampling_is_reproducible_and_counts_draws():
    logits = torch.randn(512, generator=torch.Generator().manual_seed(3))
    a, b = Sampler(0.8, 0.9, seed=11), Sampler(0.8, 0.9, seed=11)
    draws_a = [a(logits) for _ in range(20)]
    assert draws_a == [b(logits) for _ in range(20)]
    assert a.offset == 20
    assert len(set(draws_a)) > 1  # really sampling
    assert Sampler()(logits) == int(torch.argmax(logits))
    assert json.dumps(draws_a)  # plain ints
