"""MTP speculative decoding (engine.core.mtp): greedy output identical to one-token decoding, the linear-attention
states rolled back to the last accepted draft, the prefix cache told exactly what the model holds, sampling that
keeps the model's distribution (chi-square), TP2 equal to TP1, and the flags' errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from engine.core import config as ecfg
from engine.core import demo, mtp, runner, weights
from engine.core.model import Model
from engine.core.sampling import Sampler
from tests.engine_helpers import REPO

CHUNK = 16  # prefill chunk: the prompts below cross its boundaries


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py


def _load(d, prefix_bytes: int = 0, context: int = 256) -> Model:
    cfg = ecfg.load(d)
    m = Model(cfg)
    weights.load_into(m, d)
    m.setup_cache(context)
    runner.prepare(m, prefix_cache_bytes=prefix_bytes)
    return m


@pytest.fixture(scope="module")
def models(mtp_demo_dir):
    """(plain: no prefix cache, cached: with one)."""
    return _load(mtp_demo_dir), _load(mtp_demo_dir, prefix_bytes=1 << 24)


PROMPTS = [[1, 40, 41, 42, 43], [1] + [(7 * i + 3) % 250 + 3 for i in range(36)]]  # 5 and 37: three chunks of 16
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def reference(models):
    plain, _ = models
    return [runner.run(plain, p, MAX_TOKENS, Sampler(), set(), CHUNK)[0] for p in PROMPTS]


def test_the_mtp_demo_carries_the_draft_layer_over_the_plain_hybrid_weights(mtp_demo_dir, tmp_path):
    cfg = json.loads((mtp_demo_dir / "config.json").read_text())
    assert cfg["mtp_num_hidden_layers"] == 1 and cfg["v100plan"]["model_id"] == demo.MTP_ID
    plain = demo.weights_bytes(demo.HYBRID_SEED, demo.HYBRID_CONFIG)
    with_mtp = demo.weights_bytes(demo.HYBRID_SEED, dict(demo.HYBRID_CONFIG, mtp_num_hidden_layers=1))
    extra = sorted(set(with_mtp) - set(plain))
    assert all(with_mtp[n] == plain[n] for n in plain)  # the decoder's weights are the plain demo's
    assert "mtp.fc.weight" in extra and "mtp.layers.0.self_attn.q_proj.weight" in extra
    assert with_mtp["mtp.fc.weight"][0] == (256, 512)
    m = Model(ecfg.load(mtp_demo_dir))
    weights.load_into(m, mtp_demo_dir)  # every mtp.* tensor has a place and every draft-layer weight is filled
    assert m.mtp is not None and float(m.mtp.fc.abs().sum()) > 0


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_speculation_gives_exactly_the_tokens_without_it(models, reference, k):
    plain, _ = models
    for prompt, ref in zip(PROMPTS, reference):
        info: dict = {}
        out, reason = runner.run(plain, prompt, MAX_TOKENS, Sampler(), set(), CHUNK, info=info, spec_tokens=k)
        assert (out, reason) == (ref, "length")
        s = info["spec"]
        assert 0 <= s["accepted_tokens"] <= s["draft_tokens"] <= k * s["rounds"]
        # every round gives its accepted drafts plus one token; the first token comes from the prefill
        assert len(out) == 1 + s["rounds"] + s["accepted_tokens"]


@pytest.mark.parametrize("n", [15, 16, 17, 32, 33])
def test_greedy_speculation_is_exact_around_every_chunk_boundary(models, n):
    plain, _ = models
    prompt = [1] + [(11 * i + 5) % 250 + 3 for i in range(n - 1)]
    ref, _ = runner.run(plain, prompt, 6, Sampler(), set(), CHUNK)
    assert runner.run(plain, prompt, 6, Sampler(), set(), CHUNK, spec_tokens=3)[0] == ref


def test_greedy_speculation_is_exact_over_an_int8_kv_cache(mtp_demo_dir):
    m = Model(ecfg.load(mtp_demo_dir), kv_dtype="int8")
    weights.load_into(m, mtp_demo_dir)
    m.setup_cache(128)
    runner.prepare(m, prefix_cache_bytes=0)
    ref, _ = runner.run(m, PROMPTS[1], MAX_TOKENS, Sampler(), set(), CHUNK)
    assert runner.run(m, PROMPTS[1], MAX_TOKENS, Sampler(), set(), CHUNK, spec_tokens=2)[0] == ref


def test_with_the_prefix_cache_it_holds_exactly_what_was_fed_and_follow_ups_equal_cold(models, reference):
    plain, cached = models
    prompt, ref = PROMPTS[1], reference[1]
    info: dict = {}
    out, _ = runner.run(cached, prompt, MAX_TOKENS, Sampler(), set(), CHUNK, info=info, spec_tokens=3)
    assert out == ref
    assert cached.prefix.live == prompt + out[:-1]  # the last token is handed out, not yet fed
    follow = prompt + out + [50, 51, 52]
    cold, _ = runner.run(plain, follow, MAX_TOKENS, Sampler(), set(), CHUNK)
    info = {}
    warm, _ = runner.run(cached, follow, MAX_TOKENS, Sampler(), set(), CHUNK, info=info, spec_tokens=2)
    assert info["cached_tokens"] > len(prompt) and warm == cold


def _oracle(full: list[int], good: int, vocab: int):
    """Drafts that are the true continuation for the first ``good`` of each round, wrong after."""
    def draft(model, sampler, k, tokens, hidden, pos0):
        pos = pos0 + len(tokens)  # where the round's first token sits
        true = full[pos + 1:pos + 1 + k]
        true += [0] * (k - len(true))
        return [t if j < good else (t + 1) % vocab for j, t in enumerate(true)], [None] * k
    return draft


@pytest.mark.parametrize("good", [0, 1, 2, 3])
def test_accepted_counts_follow_the_drafts_and_rejections_roll_the_states_back(models, reference, monkeypatch, good):
    plain, _ = models
    prompt, ref = PROMPTS[1], reference[1]
    monkeypatch.setattr(mtp, "draft", _oracle(prompt + ref, good, plain.cfg.vocab_size))
    info: dict = {}
    out, _ = runner.run(plain, prompt, MAX_TOKENS, Sampler(), set(), CHUNK, info=info, spec_tokens=3)
    assert out == ref  # a rejected draft's linear-attention states were undone: later tokens are unchanged
    s = info["spec"]
    rounds = s["rounds"]
    # each round: min(good, drafts of the round) accepted, then one more token
    assert s["accepted_tokens"] == sum(min(good, d) for d in _round_drafts(MAX_TOKENS, 3, good))
    assert rounds == len(_round_drafts(MAX_TOKENS, 3, good))
    if good == 3:
        assert s["accepted_tokens"] == s["draft_tokens"] == 6 and rounds == 3  # 1 + (3 + 1) + (3 + 1) + 1: no draft for the last token


def _round_drafts(n: int, k: int, good: int) -> list[int]:
    """Drafts per round when each round accepts ``good`` of them (the first token is the prefill's)."""
    out, left = [], n - 1
    while left > 0:
        d = min(k, left - 1)
        out.append(d)
        left -= min(good, d) + 1
    return out


# ---- sampling keeps the distribution -------------------------------------------------------------------------

def _chi2_limit(df: int, z: float = 3.29) -> float:
    """The chi-square quantile at about 1 - 5e-4 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _two_sample(a: dict, b: dict) -> tuple[float, int]:
    keys = set(a) | set(b)
    stat = sum((a.get(x, 0) - b.get(x, 0)) ** 2 / (a.get(x, 0) + b.get(x, 0)) for x in keys)
    return stat, len(keys) - 1


def test_the_rejection_rule_draws_from_the_target_distribution():
    torch.manual_seed(0)
    p_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    q_logits = torch.tensor([0.0, 2.0, 0.0, 1.0, 0.5, -2.0])  # a poor draft: rejections and the residual both run
    s = Sampler(temperature=1.0, seed=3)
    p = torch.softmax(p_logits, -1)
    n = 12000
    counts, naive = [0] * 6, [0] * 6
    for _ in range(n):
        q = mtp._dist(s, q_logits)
        x = mtp._draw(s, q)
        naive[x] += 1
        a, nxt = mtp.accept(s, [x], [q], torch.stack([p_logits, p_logits]))
        counts[x if a == 1 else nxt] += 1
    stat = sum((c - n * float(pi)) ** 2 / (n * float(pi)) for c, pi in zip(counts, p))
    assert stat < _chi2_limit(5)
    bad = sum((c - n * float(pi)) ** 2 / (n * float(pi)) for c, pi in zip(naive, p))
    assert bad > 10 * _chi2_limit(5)  # the test can fail: the draft's own distribution is far from p


TINY = dict(model_type="qwen3_5_text", vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=64, mtp_num_hidden_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


def test_speculative_sampling_keeps_the_distribution_of_the_first_tokens():
    m = Model(ecfg.from_dict(TINY))
    weights.init_random(m, seed=5, std=0.6)  # peaked but not one-hot: the draft is right sometimes, not always
    m.setup_cache(16)
    runner.prepare(m, prefix_cache_bytes=0)
    prompt = [1, 3, 5]
    n = 1500
    plain, spec, acc, drafted = {}, {}, 0, 0
    for seed in range(n):
        out, _ = runner.run(m, prompt, 3, Sampler(1.0, seed=seed), set(), 8)
        plain[tuple(out[:2])] = plain.get(tuple(out[:2]), 0) + 1
        info: dict = {}
        out, _ = runner.run(m, prompt, 3, Sampler(1.0, seed=seed), set(), 8, info=info, spec_tokens=2)
        spec[tuple(out[:2])] = spec.get(tuple(out[:2]), 0) + 1
        acc += info["spec"]["accepted_tokens"]
        drafted += info["spec"]["draft_tokens"]
    assert 0.05 * drafted < acc < 0.95 * drafted  # both the acceptance and the rejection branch ran often
    stat, df = _two_sample(plain, spec)
    assert stat < _chi2_limit(df), (stat, df)


# ---- TP2 and the flags ---------------------------------------------------------------------------------------

def _generate(d, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(d), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_tp2_speculative_generate_equals_tp1_and_reports_the_counts(mtp_demo_dir, reference):
    ids = ",".join(map(str, PROMPTS[1]))
    outs = []
    for tp in ("1", "2"):
        proc = _generate(mtp_demo_dir, "--tp", tp, "--prompt-ids", ids, "--max-tokens", str(MAX_TOKENS),
                         "--speculative", "mtp", "--draft-tokens", "3", "--json")
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert outs[0]["token_ids"] == outs[1]["token_ids"] == reference[1]
    assert outs[0]["spec"] == outs[1]["spec"] and outs[0]["spec"]["draft_tokens"] > 0


def test_bad_speculation_flags_exit_2_with_the_reason(mtp_demo_dir, tmp_path):
    proc = _generate(mtp_demo_dir, "--prompt-ids", "1,2", "--speculative", "mtp", "--draft-tokens", "5")
    assert proc.returncode == 2 and "--draft-tokens must be 1 to 4, got 5" in proc.stderr
    plain = tmp_path / "plain"
    demo.make(plain, arch="qwen3_5")
    proc = _generate(plain, "--prompt-ids", "1,2", "--speculative", "mtp")
    assert proc.returncode == 2 and "make-demo-model DIR --arch qwen3_5 --mtp" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_served_speculative_answer_equals_one_token_decoding_and_metrics_count_the_drafts(mtp_demo_dir, reference):
    from tests.test_service_support import ServiceProcess

    svc = ServiceProcess("--speculative", "mtp", "--draft-tokens", "2", model=str(mtp_demo_dir))
    try:
        svc.wait_healthy()
        model_id = svc.client.get("/v1/models").json()["data"][0]["id"]
        r = svc.client.post("/v1/completions", json={"model": model_id, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS,
                                                     "temperature": 0.0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["v100plan"]["token_ids"] == reference[1]
        metrics = svc.client.get("/metrics").text
        counts = {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("v100plan_spec_")}
        assert counts["v100plan_spec_draft_tokens_total"] > 0
        assert 0 <= counts["v100plan_spec_accepted_tokens_total"] <= counts["v100plan_spec_draft_tokens_total"]
        spec = svc.client.get("/health").json()["speculation"]  # the settings and the acceptance since start
        drafted, accepted = (int(counts[f"v100plan_spec_{k}_tokens_total"]) for k in ("draft", "accepted"))
        assert spec == {"method": "mtp", "draft_tokens": 2, "mode": "eager", "drafted_tokens": drafted,
                        "accepted_tokens": accepted, "acceptance_rate": round(accepted / drafted, 4)}
    finally:
        svc.stop()


def test_serve_passes_the_drafts_to_the_ranks_and_refuses_a_bad_count(mtp_demo_dir):
    import argparse

    from engine.service import serve_config as sc

    p = argparse.ArgumentParser()
    sc.add_serve_arguments(p)
    cfg = sc.config_from_args(p.parse_args(["--model", str(mtp_demo_dir), "--speculative", "mtp", "--draft-tokens", "2"]))
    assert cfg.draft_tokens == 2
    cmd = sc.rank_command(cfg, 0, 1, "/tmp/rv", "/tmp/sock")
    assert cmd[cmd.index("--speculative") + 1] == "mtp" and cmd[cmd.index("--draft-tokens") + 1] == "2"
    off = sc.config_from_args(p.parse_args(["--model", str(mtp_demo_dir)]))
    assert off.draft_tokens == 0 and "--speculative" not in sc.rank_command(off, 0, 1, "/tmp/rv", "/tmp/sock")
    with pytest.raises(sc.ServeConfigError, match="--draft-tokens must be 1 to 4, got 0"):
        sc.config_from_args(p.parse_args(["--model", str(mtp_demo_dir), "--speculative", "mtp", "--draft-tokens", "0"]))
