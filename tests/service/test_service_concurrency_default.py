"""The requests `serve` decodes at once when it is given no --max-concurrency (docs/service.md, "Default
concurrency"): 1 with MTP, with a vision tower or on CPU, else as many sequences of the served context as fit the card
beside the weights (the planner's own arithmetic, engine/memory_fit.py), at most 64; the flag always wins. No service
is started here: the CPU service's /health is checked in test_service_context.py."""

from __future__ import annotations

import argparse
import json

import pytest

from engine import memory_fit
from engine.core import config as engine_config
from engine.service import concurrency_default, context_default, rank_cli
from engine.service.serve_config import ServeConfigError, add_serve_arguments, config_from_args, rank_command
from tests.paths import REPO
from v100plan.planning import plan_document

CONFIG_27B = REPO / "engine/data/qwen3.5-27b.config.json"
H200 = context_default.Card(capacity_bytes=143771 * 2**20, held_bytes=27.663e9, name="NVIDIA H200")
V100_32GB = 32 * 2**30


@pytest.fixture(scope="module")
def cfg27b(tmp_path_factory):
    d = tmp_path_factory.mktemp("cfg27b")
    (d / "config.json").write_text(CONFIG_27B.read_text())
    return engine_config.load(str(d))


def _serve(tmp_path, *argv: str, config: dict | None = None):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config or {"max_position_embeddings": 4096}))
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return config_from_args(p.parse_args(["--model", str(model), "--state-dir", str(tmp_path / "state"), *argv]))


def test_the_27b_on_an_h200_serves_as_many_native_contexts_as_fit(cfg27b):
    """Context first (native 262,144 fits one sequence), then how many of it fit: the arithmetic done again here
    from the card's bytes, and the planner's sequences_that_fit for the same card less at most one (the engine also
    holds its MTP layer's K/V and the RoPE tables)."""
    ctx = context_default.choose(None, cfg27b, world=2, dtype_bytes=2, kv_int8=False, card=H200)
    assert ctx["max_context"] == 262144 and ctx["bound"] == "native"
    got = concurrency_default.from_memory(262144, cfg27b, world=2, dtype_bytes=2, kv_int8=False, card=H200)
    reserve = memory_fit.runtime_reserve()[0] * 1e9
    # K/V of 16 + 1 MTP layers; no batched-step workspace: the attention kernel reads each slot in place
    slot = 262144 * 17 * (4 // 2) * 256 * 2 * 2 + context_default.state_bytes(cfg27b, 2, 2)
    rope = 262144 * 2 * cfg27b.rotary_dim * 2
    want = int((H200.capacity_bytes - H200.held_bytes - reserve - rope) // slot)
    assert got["max_concurrency"] == got["fits"] == want == 12 and got["bound"] == "memory"
    assert "12 at once" in got["why"] and "NVIDIA H200" in got["why"] and "runtime reserve" in got["why"]
    assert "workspace" not in got["why"]
    doc = plan_document("h200", 2, str(CONFIG_27B), "v100plan", "256K", None, 1, "latency", weights="bf16")
    (tp2,) = [s for s in doc["strategies"] if s["name"] == "tp2"]
    planned = tp2["breakdown"]["memory"]["sequences_that_fit"]
    assert planned - 1 <= want <= planned
    # A restart pins that N (--max-concurrency 12, no --max-context): the context for 12 sequences is the same one.
    pinned = context_default.choose(None, cfg27b, world=2, dtype_bytes=2, kv_int8=False, card=H200, sequences=12)
    assert pinned["max_context"] == 262144 and pinned["fits"] >= 262144


def test_a_memory_bound_context_leaves_room_for_one_sequence(cfg27b):
    """Two V100-SXM2-32GB: the native context does not fit one sequence, so the context is what fits and one
    sequence of it is served; that pinned again gives the same context."""
    held = 27.66e9
    card = context_default.Card(capacity_bytes=V100_32GB, held_bytes=held, name="Tesla V100-SXM2-32GB")
    ctx = context_default.choose(None, cfg27b, world=2, dtype_bytes=2, kv_int8=False, card=card)
    assert ctx["bound"] == "memory"
    got = concurrency_default.from_memory(ctx["max_context"], cfg27b, world=2, dtype_bytes=2, kv_int8=False, card=card)
    assert got["max_concurrency"] == 1 and got["bound"] == "memory" and got["fits"] == 1
    again = context_default.choose(None, cfg27b, world=2, dtype_bytes=2, kv_int8=False, card=card, sequences=1)
    assert again["max_context"] == ctx["max_context"]
    # A smaller context given by flag: more of it fit. Four sequences given by flag: the context fits four.
    short = concurrency_default.from_memory(8192, cfg27b, world=2, dtype_bytes=2, kv_int8=False, card=card)
    assert short["bound"] == "memory" and 1 < short["max_concurrency"] < 64
    four = context_default.choose(None, cfg27b, world=2, dtype_bytes=2, kv_int8=False, card=card, sequences=4)
    assert ctx["max_context"] // 5 < four["max_context"] <= ctx["max_context"] // 4
    assert "for each of 4 sequences (--max-concurrency 4)" in four["why"]
    # The flag with no room for its sequences is refused naming the flag to lower.
    with pytest.raises(ValueError, match="a smaller --max-concurrency"):
        context_default.choose(None, cfg27b, world=2, dtype_bytes=2, kv_int8=False, card=card, sequences=1 << 20)


def test_a_small_model_on_a_large_card_stops_at_the_cap(cfg27b):
    got = concurrency_default.from_memory(1024, cfg27b, world=2, dtype_bytes=2, kv_int8=False, card=H200)
    assert got["max_concurrency"] == 64 and got["bound"] == "cap" and got["fits"] > 64 and "64 at once" in got["why"]
    # not even one sequence of a context given by flag: one at a time, never zero
    none = concurrency_default.from_memory(1 << 24, cfg27b, world=2, dtype_bytes=2, kv_int8=False, card=H200)
    assert none["max_concurrency"] == 1 and none["fits"] == 0 and "not even one" in none["why"]
    # a CPU rank has no card: one at a time
    assert concurrency_default.from_memory(4096, cfg27b, world=2, dtype_bytes=4, kv_int8=False, card=None)["bound"] == "cpu"


def test_serve_decides_n_before_the_ranks_where_its_flags_or_the_model_do(tmp_path):
    cpu = _serve(tmp_path)
    assert (cpu.max_concurrency, cpu.concurrency_bound) == (1, "cpu") and "on CPU" in cpu.concurrency_why
    gpu = _serve(tmp_path, "--device", "cuda")
    assert gpu.max_concurrency is None and gpu.concurrency_bound == "memory"  # the ranks choose
    mtp = _serve(tmp_path, "--device", "cuda", "--speculative", "mtp", "--draft-tokens", "2")
    assert (mtp.max_concurrency, mtp.concurrency_bound) == (1, "mtp") and "--speculative mtp" in mtp.concurrency_why
    vision = {"max_position_embeddings": 4096, "vision_config": {"depth": 1}}
    # a vision tower does not bound it: images run per slot (engine/service/rank_batch_images.py)
    assert _serve(tmp_path, "--device", "cuda", config=vision).max_concurrency is None
    # the flag wins over every default
    for argv, config in ((["--device", "cpu"], None), (["--device", "cuda"], vision), (["--device", "cuda"], None)):
        given = _serve(tmp_path, *argv, "--max-concurrency", "3", config=config)
        assert (given.max_concurrency, given.concurrency_bound) == (3, "flag")
    # MTP with N given is served with N (per-slot rounds); out of range stays refused
    assert _serve(tmp_path, "--max-concurrency", "2", "--speculative", "mtp", "--draft-tokens", "2").max_concurrency == 2
    for bad in (["--max-concurrency", "0"], ["--max-concurrency", "65"]):
        with pytest.raises(ServeConfigError, match="--max-concurrency"):
            _serve(tmp_path, *bad)


def test_the_rank_is_told_to_choose_from_memory_and_on_its_share_of_a_shared_card(tmp_path):
    def flags(cfg):
        cmd = rank_command(cfg, 0, 1, "/tmp/rdv", "/tmp/r0.sock")
        return cmd[cmd.index("rank") + 1:]

    gpu = flags(_serve(tmp_path, "--device", "cuda"))
    assert gpu[gpu.index("--max-concurrency") + 1] == "memory" and "--card-share" not in gpu
    shared = flags(_serve(tmp_path, "--device", "cuda:0,cuda:0", "--max-context", "2048"))
    assert shared[shared.index("--card-share") + 1] == "0.5"  # the context is given, the slots are not
    assert "--card-share" not in flags(_serve(tmp_path, "--device", "cuda:0,cuda:0", "--max-context", "2048",
                                              "--max-concurrency", "2"))
    assert "--max-concurrency" not in flags(_serve(tmp_path))  # CPU: 1, the rank's own default
    assert flags(_serve(tmp_path, "--max-concurrency", "4"))[-3:] != ["--max-concurrency", "memory"]
    p = argparse.ArgumentParser()
    rank_cli.add_args(p)
    base = ["--rank", "0", "--rendezvous", "/tmp/x", "--control-socket", "/tmp/x.sock", "--model", "/tmp/m"]
    assert p.parse_args([*base, "--max-concurrency", "memory"]).max_concurrency == "memory"
    # a restart pins the first pair's figure after serve's `memory`: the last one given wins
    assert p.parse_args([*base, "--max-concurrency", "memory", "--max-concurrency", "7"]).max_concurrency == 7
    with pytest.raises(SystemExit):
        p.parse_args([*base, "--max-concurrency", "lots"])


def test_where_the_attention_kernel_does_not_hold_the_shape_each_slot_plans_the_torch_forms_gathered_window(cfg27b):
    """A head dimension the kernel does not hold (96: not a power of two) runs the batched step's torch attention,
    which gathers each row's window: K and V (2 x 2 kv heads x 96 x 2 bytes a position at TP2), the scores, their
    softmax and the probabilities of 12 heads (4 + 4 + 2 bytes each) and the mask's 4; the 27B's own shape: 0."""
    from dataclasses import replace

    assert context_default.batch_workspace_bytes_per_position(cfg27b, 2, 2, False) == 0.0
    odd = replace(cfg27b, head_dim=96)
    assert context_default.batch_workspace_bytes_per_position(odd, 2, 2, False) == 2 * 2 * 96 * 2 + 12 * 10 + 4
    got = concurrency_default.from_memory(65536, odd, world=2, dtype_bytes=2, kv_int8=False, card=H200)
    assert "KiB batched-step workspace" in got["why"]
