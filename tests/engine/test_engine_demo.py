"""The demo model: byte-identical weights, an ASCII tokenizer whose pieces concatenate, wide top-1 margins."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import torch

from engine.core import config as ecfg
from engine.core import demo, runner, weights
from engine.core.model import Model
from engine.core.sampling import Sampler
from engine.core.tokenizer import Tokenizer
from tests import engine_helpers
from tests.engine_helpers import REPO

demo_dir = engine_helpers.demo_dir

# sha256 of model.safetensors for seed 8: written byte by byte from PCG64's raw stream, so it must not
# change with numpy, torch or safetensors versions. A change here means the demo model changed.
DEMO_SHA256 = "4988f9f5ea279c1303719e3484dc4a39bf1aa3c5b3145a24244ff502d394d322"
PROMPTS = ["Hello there, the world!\n", "<|user|>What is a V100?<|end|>\n<|assistant|>", "a",
           "The quick brown fox", "1,2,3"]


def test_weights_are_byte_identical_to_the_recorded_hash(demo_dir):
    digest = hashlib.sha256((demo_dir / "model.safetensors").read_bytes()).hexdigest()
    assert digest == DEMO_SHA256


def test_cli_writes_the_same_files_again(demo_dir, tmp_path):
    r = subprocess.run([sys.executable, "-m", "engine", "make-demo-model", str(tmp_path / "again")], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["model_id"] == "v100plan-demo"
    assert 2_000_000 < summary["parameters"] < 5_000_000
    for name in ("model.safetensors", "config.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (demo_dir / name).read_bytes(), name


def test_config_carries_model_id_bos_rule_and_chat_template(demo_dir):
    cfg = json.loads((demo_dir / "config.json").read_text())
    assert cfg["v100plan"]["model_id"] == "v100plan-demo"
    tok_cfg = json.loads((demo_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["add_bos_token"] is True and "<|assistant|>" in tok_cfg["chat_template"]
    tok = Tokenizer(demo_dir)
    assert tok.encode("hi")[0] == cfg["bos_token_id"]
    chat = tok.render_chat([{"role": "user", "content": "hi"}])
    assert chat == demo.render_chat([{"role": "user", "content": "hi"}]) == "<|user|>hi<|end|>\n<|assistant|>"


def test_every_token_decodes_to_ascii_and_pieces_concatenate(demo_dir):
    tok = Tokenizer(demo_dir)
    for i in range(tok.tok.get_vocab_size()):
        piece = tok.decode([i], skip_special=False)
        assert piece.isascii() and piece != "", i
    text = "Streaming: pieces, joined, give back the text!\n  Twice."
    ids = tok.encode(text)[1:]  # without BOS
    assert "".join(tok.decode([i]) for i in ids) == text == tok.decode(ids)


def test_greedy_top1_margins_sit_far_above_float32_noise(demo_dir):
    """TP2 sums two half-width products; float32 rounding moves logits by ~1e-6 of their size. The margin
    between the best and second-best logit must stay far above that for TP2 to pick TP1's tokens."""
    cfg = ecfg.load(demo_dir)
    m = Model(cfg)
    weights.load_into(m, demo_dir)
    m.setup_cache(256)
    tok = Tokenizer(demo_dir)
    worst = float("inf")
    for p in PROMPTS:
        ids = tok.encode(p)
        logits = m.forward(torch.tensor([ids]), 0)
        pos = len(ids)
        for _ in range(64):
            top = torch.topk(logits, 2).values
            worst = min(worst, (top[0] - top[1]).item() / logits.abs().max().item())
            nxt = int(torch.argmax(logits))
            logits = m.forward(torch.tensor([[nxt]]), pos)
            pos += 1
    assert worst > 1e-4  # relative margin: at least ~100x the float32 disagreement of TP2 vs TP1


def test_generation_is_deterministic(demo_dir):
    cfg = ecfg.load(demo_dir)
    outs = []
    for _ in range(2):
        m = Model(cfg)
        weights.load_into(m, demo_dir)
        m.setup_cache(128)
        outs.append(runner.run(m, [1, 50, 60], 20, Sampler(0.7, 0.95, seed=5), set(), 64)[0])
    assert outs[0] == outs[1] and len(outs[0]) == 20
