"""Random-weights models (engine.core.random_weights): a config's shape served with weights generated at load,
placed exactly as a checkpoint of the same tensors would be, the same model at TP1 and TP2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.core import config as ecfg
from engine.core import random_weights, shard, weights
from engine.core.model import Model
from tests.engine_helpers import REPO

SHAPE = dict(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], vocab_size=512, hidden_size=128,
             intermediate_size=256, num_hidden_layers=4, full_attention_interval=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=6,
             linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
             max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.25})


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rnd")
    cfg = d / "shape.json"
    cfg.write_text(json.dumps(SHAPE))
    proc = _cli("make-random-model", str(d / "model"), "--config", str(cfg), "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["files"] == ["config.json", random_weights.FILE]
    return d / "model"


def test_random_load_equals_a_checkpoint_of_the_same_tensors(random_dir, tmp_path):
    cfg = ecfg.load(random_dir)
    g = torch.Generator().manual_seed(3)
    tensors = {n: random_weights.value(n, s, cfg, torch.float32, "cpu", g).contiguous()
               for n, s in random_weights.hf_shapes(cfg)}
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text((random_dir / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    a, b = Model(cfg), Model(ecfg.load(tmp_path))
    weights.load_into(a, random_dir)
    weights.load_into(b, tmp_path)
    assert a.weights_info()["origin"] == "random" and "origin" not in b.weights_info()
    pairs = list(zip(weights.expected_tensors(a), weights.expected_tensors(b), strict=True))
    assert len(pairs) > 20
    for (la, ta), (lb, tb) in pairs:
        assert la == lb and torch.equal(ta, tb), la
    # not a constant: the matrices are drawn (a wrong placement or an all-zero fill would show here)
    assert a.layers[0].w_in.std() > 0.01


def test_tp2_of_a_random_model_answers_with_tp1s_tokens(random_dir):
    outs = []
    for tp in ("1", "2"):
        proc = _cli("generate", "--model", str(random_dir), "--tp", tp, "--prompt-ids", "1,17,300,42,5",
                    "--max-tokens", "12", "--json")
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert outs[0]["token_ids"] == outs[1]["token_ids"] and len(outs[0]["token_ids"]) == 12
    assert outs[0]["weights"]["origin"] == outs[1]["weights"]["origin"] == "random"


def test_random_models_are_refused_where_they_make_no_sense(random_dir, tmp_path):
    with pytest.raises(ValueError, match="random-weights model"):
        shard.shard(random_dir, tmp_path / "split", 2)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = _cli("make-random-model", str(tmp_path / "x"), "--config", str(bad))
    assert proc.returncode == 2 and "cannot read --config" in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"")
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(SHAPE))
    proc = _cli("make-random-model", str(tmp_path / "ckpt"), "--config", str(ok))
    assert proc.returncode == 2 and "safetensors" in proc.stderr


def test_layers_keeps_the_pattern_of_layer_kinds(tmp_path):
    proc = _cli("make-random-model", str(tmp_path / "m"), "--config", str(REPO / "engine/data/qwen3.5-27b.config.json"),
                "--layers", "8")
    assert proc.returncode == 0, proc.stderr
    cfg = ecfg.load(tmp_path / "m")
    assert cfg.num_layers == 8 and cfg.layer_types.count("full_attention") == 2
    assert cfg.layer_types[3] == "full_attention" and cfg.layer_types[0] == "linear_attention"
