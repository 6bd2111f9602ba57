"""How many requests a deployed engine decodes at once (serve --max-concurrency): a plan's concurrency is the served
N, --max-concurrency N (or memory: serve's own default) overrides it, the release pins it, status says what /health
says, a GPU release on serve's memory default needs its whole card (no blue/green beside another), and qualify --host
serves the engine's default. No SSH here: the settings, the switch and the CLI's refusals."""

from __future__ import annotations

import pytest

from tests import sshd as sshd_mod
from tests.deploy.test_deploy_room import H200_PAIR
from tests.paths import REPO
from tests.remote_support import v100_pair_with_h200_torch
from v100plan.errors import BadInput
from v100plan.planning import plan_document
from v100plan.remote import release as rel
from v100plan.remote import room
from v100plan.remote.own_plan import settings_for_host

CONFIG_27B = REPO / "tests/fixtures/planner/qwen3.5-27b-gptq-multimodal.config.json"
NOBODY = f"root@127.0.0.1:{sshd_mod.free_port()}"  # nothing listens: a command that connected would say so


def _plan(concurrency: int = 1) -> dict:
    v100, _ = v100_pair_with_h200_torch()
    return plan_document(v100, None, str(CONFIG_27B), "v100plan", "4096", None, concurrency, "latency")


def test_the_plans_concurrency_is_served_and_pinned():
    s, why = rel.settings_from_plan(_plan(), "plan.json", 8000, False)
    assert s.max_concurrency == 1 and "1 request at a time (the plan's concurrency)" in why
    flags = s.serve_flags("/m", "/k")
    assert flags[flags.index("--max-concurrency") + 1] == "1"
    assert s.pinned()["max_concurrency"] == 1 and s.launch()["max_concurrency"] == 1
    # a plan made before the launch settings said their concurrency: the engine's default, and the release id of a
    # release made before the field is kept (absent from what is pinned)
    old = _plan()
    del old["launch"]["concurrency"]
    s, why = rel.settings_from_plan(old, "old.json", 8000, False)
    assert s.max_concurrency is None and "the engine's default" in why
    assert "max_concurrency" not in s.pinned() and "--max-concurrency" not in s.serve_flags("/m", "/k")


def test_deploys_own_plan_and_the_probe_serve_one_request_at_a_time_on_gpus():
    v100, _ = v100_pair_with_h200_torch()
    s, why, origin = settings_for_host(v100, CONFIG_27B, "box", 8000, False, None)
    assert s.max_concurrency == 1 and "1 request at a time (the plan's concurrency)" in why and origin["concurrency"] == 1
    s, _ = rel.settings_from_probe(v100, "box", 8000, False, None)
    assert s.device == "cuda" and s.max_concurrency == 1
    s, _ = rel.settings_from_probe({"cards": []}, "box", 8000, False, None)
    assert s.device == "cpu" and s.max_concurrency is None  # serve's default: 1 on CPU


def test_the_flag_overrides_the_plan_and_memory_asks_for_serves_default():
    s, _ = rel.settings_from_plan(_plan(), "plan.json", 8000, False)
    for given, want in (("8", 8), ("memory", None)):
        got, said = rel.with_overrides(s, rel.overrides_from_flags(None, None, None, None, None, None, given))
        assert got.max_concurrency == want and f"given: --max-concurrency {given}" in said
    for bad in ("0", "65", "lots", "2.5"):
        with pytest.raises(BadInput, match="--max-concurrency"):
            rel.overrides_from_flags(None, None, None, None, None, None, bad)
    # the plan speculates (the 27B's MTP layer): N > 1 beside it is served (per-slot MTP rounds) and said
    many, said = rel.with_overrides(s, rel.overrides_from_flags(None, None, None, None, None, None, "4"))
    assert many.draft_tokens > 0 and many.max_concurrency == 4
    flags = many.serve_flags("/m", "/k")
    assert flags[flags.index("--max-concurrency") + 1] == "4" and "--speculative" in flags


def test_status_says_what_health_says_and_else_the_release():
    engine = {"device": "cuda", "max_concurrency": None}
    health = {"concurrency": {"max_concurrency": 12, "bound": "memory", "why": "12 at once"}}
    assert "12 at once (memory)" in rel.settings_sentence(engine, health)
    assert "3 at once" in rel.settings_sentence({**engine, "max_concurrency": 3}, {})
    assert "requests at once: the engine's default" in rel.settings_sentence(engine, {})


def test_a_release_on_serves_memory_default_needs_its_whole_card():
    cards = room.parse_cards("0, 0, 143771, 143771\n1, 0, 143771, 143771\n")  # two idle H200s
    one = rel.EngineSettings(device="cuda", max_concurrency=1)
    assert room.choose("auto", one, cards, "nvidia-smi", [30 << 30] * 2, "r1", "box").mode == "blue-green"
    auto = rel.EngineSettings(device="cuda")
    sw = room.choose("auto", auto, cards, "nvidia-smi", [30 << 30] * 2, "r1", "box")
    assert sw.mode == "stop-start" and "needs the whole card" in sw.why and not any(g["fits"] for g in sw.gpus)
    with pytest.raises(BadInput, match="cannot start beside release r1"):
        room.choose("blue-green", auto, cards, "nvidia-smi", [30 << 30] * 2, "r1", "box")
    # N slots need N x the K/V of one
    cfg = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}
    w = [7_000_000_000] * 2
    n1 = room.rank_need_bytes(cfg, rel.EngineSettings(device="cuda", max_context=4096, max_concurrency=1), w)[0]
    n4 = room.rank_need_bytes(cfg, rel.EngineSettings(device="cuda", max_context=4096, max_concurrency=4), w)[0]
    assert n4 - n1 == 3 * 4096 * 131072 // 2
    assert room.choose("auto", rel.EngineSettings(), room.parse_cards(H200_PAIR), "", [1, 1], "r1", "box").mode \
        == "blue-green"  # CPU settings on a host with cards: the old rule


def test_qualify_host_serves_the_engines_default():
    from v100plan.qualify.host import HostRun

    run = object.__new__(HostRun)
    run.device, run.port, run.label = "auto", 8000, "box"
    v100, _ = v100_pair_with_h200_torch()
    s, chose = run.settings(v100, _plan())
    assert s.device == "cuda" and s.max_concurrency is None and "the engine's default" in chose
    s, chose = run.settings(v100, None)  # no plan: the probe's settings, the same default
    assert s.max_concurrency is None


def test_the_cli_refuses_a_bad_max_concurrency_before_connecting(cli):
    r = cli("deploy", NOBODY, "--demo-model", "--max-concurrency", "65")
    assert r.exit_code == 2, r.stderr
    err = sshd_mod.flat(r.stderr)
    assert "--max-concurrency '65': give 1 to 64, or memory" in err and "Traceback" not in err and "SSH" not in err
