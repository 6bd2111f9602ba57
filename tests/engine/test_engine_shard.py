"""The shard tool: split per the table, reassemble bit-exactly, refuse what does not divide."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.core import config as ecfg
from engine.core import shard, weights
from engine.core.model import Model
from tests import engine_helpers
from tests.engine_helpers import REPO, make_hf_model, small_config

demo_dir = engine_helpers.demo_dir


def _run(*args):
    return subprocess.run([sys.executable, "-m", "engine", "shard", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_cli_shards_the_demo_and_reports_kinds_and_bytes(demo_dir, tmp_path):
    r = _run(demo_dir, tmp_path / "s", "--tp", "2")
    assert r.returncode == 0, r.stderr
    assert "reassembled bit-exactly" in r.stdout
    for word in ("colwise", "rowwise", "vocab", "replicated", "rank 0:", "rank 1:"):
        assert word in r.stdout
    m = json.loads((tmp_path / "s" / "shard.json").read_text())
    assert m["tensors"]["model.layers.0.self_attn.q_proj.weight"] == "colwise"
    assert m["tensors"]["model.layers.0.mlp.down_proj.weight"] == "rowwise"
    assert m["tensors"]["lm_head.weight"] == "vocab"
    assert m["tensors"]["model.embed_tokens.weight"] == "replicated"
    assert m["bytes_per_rank"][0] == m["bytes_per_rank"][1]
    assert (tmp_path / "s" / "rank1" / "tokenizer.json").exists()


def test_tied_biased_model_shards_and_loads_like_slicing_at_load(tmp_path):
    src = tmp_path / "qwen2"
    make_hf_model("qwen2.5-0.5b", src)  # tied head, q/k/v biases
    man = shard.shard(src, tmp_path / "s", 2)
    assert man["tensors"]["lm_head.weight"] == "vocab"  # written out from the tied embedding
    assert man["tensors"]["model.layers.0.self_attn.q_proj.bias"] == "colwise"
    cfg = ecfg.load(src)
    for r in range(2):
        from_shard, sliced = Model(cfg, world=2, rank=r), Model(cfg, world=2, rank=r)
        weights.load_into(from_shard, tmp_path / "s")
        weights.load_into(sliced, src)
        for (name, a), (_, b) in zip(weights.expected_tensors(from_shard), weights.expected_tensors(sliced)):
            assert torch.equal(a, b), name


def test_verify_catches_a_corrupted_shard(demo_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    shard.shard(demo_dir, tmp_path / "s", 2)
    f = tmp_path / "s" / "rank1" / "model.safetensors"
    sd = load_file(str(f))
    sd["model.layers.2.mlp.up_proj.weight"][0, 0] += 1.0
    save_file(sd, str(f))
    m = json.loads((tmp_path / "s" / "shard.json").read_text())
    originals = {n: (demo_dir / "model.safetensors", n) for n in m["tensors"]}
    with pytest.raises(RuntimeError, match="up_proj.weight does not reassemble"):
        shard.verify(tmp_path / "s", 2, m["tensors"], originals)


def test_refuses_shapes_that_do_not_divide(tmp_path):
    src = tmp_path / "odd"
    src.mkdir()
    raw = small_config("llama-3.1-8b")
    raw.update(num_attention_heads=3, num_key_value_heads=3, hidden_size=96, vocab_size=511)
    (src / "config.json").write_text(json.dumps(raw))
    r = _run(src, tmp_path / "out", "--tp", "2")
    assert r.returncode == 2
    assert "num_attention_heads = 3 is not divisible by 2" in r.stderr
    assert "vocab_size = 511 is not divisible by 2" in r.stderr
    assert not (tmp_path / "out").exists()


def test_refuses_a_non_empty_destination(demo_dir, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    r = _run(demo_dir, tmp_path / "busy")
    assert r.returncode == 2 and "not empty" in r.stderr
    assert (tmp_path / "busy" / "keep.txt").exists()


def test_a_shard_dir_for_another_tp_is_refused(demo_dir, tmp_path):
    shard.shard(demo_dir, tmp_path / "s", 2)
    with pytest.raises(weights.WeightsError, match="sharded for tp 2"):
        weights.load_into(Model(ecfg.load(demo_dir)), tmp_path / "s")


def test_generate_tp2_from_a_shard_directory_matches_tp1(demo_dir, tmp_path):
    import json as _json

    shard.shard(demo_dir, tmp_path / "s", 2)
    outs = []
    for model, tp_ in ((demo_dir, "1"), (tmp_path / "s", "2")):
        r = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(model), "--tp", tp_,
                            "--prompt", "Shards!", "--max-tokens", "12", "--json"], cwd=REPO, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(_json.loads(r.stdout.strip().splitlines()[-1]))
    assert outs[0]["token_ids"] == outs[1]["token_ids"] and outs[0]["text"] == outs[1]["text"] is not None


def test_the_same_checkpoint_splits_into_the_same_bytes(demo_dir, tmp_path):
    """A deployment's release id is made of the shards' SHA-256: splitting again must not change them
    (save_file writes the header's metadata in a hash map's order; shard sorts it)."""
    import hashlib

    digests = []
    for name in ("a", "b"):
        shard.shard(demo_dir, tmp_path / name, 2)
        digests.append({p.relative_to(tmp_path / name).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                        for p in sorted((tmp_path / name).rglob("*.safetensors"))})
    assert digests[0] == digests[1] and len(digests[0]) == 2


def test_serve_runs_a_shard_directory_and_answers_as_tp1_on_the_unsplit_model(demo_dir, tmp_path):
    """`python -m engine serve --model SHARD_DIR`: the proxy reads config.json and the tokenizer from rank0/
    (there are none at the top of a shard directory), each rank loads its own rankN/."""
    import argparse

    from engine.service.proxy_text import load_model_text
    from engine.service.serve_config import add_serve_arguments, config_from_args
    from tests.test_service_support import ServiceProcess, expected_tokens, prompt_ids

    s = tmp_path / "s"
    shard.shard(demo_dir, s, 2)
    assert not (s / "config.json").exists()
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert config_from_args(p.parse_args(["--model", str(s)])).model_dir == str(s.resolve())
    whole, split = load_model_text(str(demo_dir), None), load_model_text(str(s), None)
    assert split.model_id == whole.model_id == "v100plan-demo"
    assert (split.vocab_size, split.eos_token_ids) == (whole.vocab_size, whole.eos_token_ids)
    assert split.encode_prompt("Shards!") == whole.encode_prompt("Shards!")

    svc = ServiceProcess(model=str(s))
    try:
        svc.wait_healthy()
        r = svc.complete("Shards!", 12)
        assert r.status_code == 200, r.text
        assert r.json()["v100plan"]["token_ids"] == expected_tokens(prompt_ids("Shards!"), 12)
    finally:
        svc.stop()
