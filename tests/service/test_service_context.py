"""The context `serve` runs without --max-context: the model's native one, bounded by what fits the card with the
planner's own memory arithmetic (engine/memory_fit.py), and said in the log and /health. The service test starts a
real `python -m engine serve` on the demo model and talks HTTP to it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import memory_fit
from engine.core import config as engine_config
from engine.service import context_default
from tests.paths import REPO
from tests.test_service_support import MODEL_ID, service_fixture
from v100plan import catalogue
from v100plan.planning import plan_document

CONFIG_27B = REPO / "engine/data/qwen3.5-27b.config.json"
V100_32GB = 32 * 2**30  # bytes nvidia-smi gives a V100-SXM2-32GB (the catalogue's 32 GiB)


def test_the_reserve_is_the_profiles_figure():
    reserve, source = memory_fit.runtime_reserve()
    assert reserve == catalogue.get("engine", "v100plan")["efficiency"]["runtime_reserve_gb"]["value"]
    assert "H200" in source and "measured" in source


def test_flag_and_cpu_bounds(cfg27b):
    flag = context_default.choose(8192, cfg27b, world=2, dtype_bytes=2, kv_int8=False, card=None)
    assert flag["max_context"] == 8192 and flag["bound"] == "flag" and "--max-context 8192" in flag["why"]
    cpu = context_default.choose(None, cfg27b, world=2, dtype_bytes=4, kv_int8=False, card=None)
    assert cpu["max_context"] == cfg27b.max_position_embeddings == 262144 and cpu["bound"] == "native"


def test_two_v100s_bound_the_27b_by_memory_as_the_planner_does(cfg27b):
    """The 27B hybrid in 16-bit on two V100-SXM2-32GB: the engine's default and the planner's max context come from
    one arithmetic; the engine also counts its MTP layer's K/V and its RoPE tables, so it fits a few % fewer."""
    doc = plan_document("v100-sxm2-32gb", 2, str(CONFIG_27B), "v100plan", "200K", None, 1, "latency", weights="bf16")
    (tp2,) = [s for s in doc["strategies"] if s["name"] == "tp2"]
    held = tp2["breakdown"]["memory"]["weights_gb"] * 1e9
    card = context_default.Card(capacity_bytes=V100_32GB, held_bytes=held, name="Tesla V100-SXM2-32GB")
    ctx = context_default.choose(None, cfg27b, world=2, dtype_bytes=2, kv_int8=False, card=card)
    assert ctx["bound"] == "memory" and ctx["max_context"] == ctx["fits"] < 262144
    assert 0.9 * tp2["max_context"] < ctx["max_context"] <= tp2["max_context"]
    assert "runtime reserve" in ctx["why"] and "Tesla V100-SXM2-32GB" in ctx["why"]
    # int8 K/V nearly doubles it (1 + 4/256 bytes an element against 2)
    int8 = context_default.choose(None, cfg27b, world=2, dtype_bytes=2, kv_int8=True, card=card)
    assert 1.8 * ctx["max_context"] < int8["max_context"] < 2 * ctx["max_context"]
    # Two ranks on one card plan on half of it each; weights that leave no room are refused with what to change.
    with pytest.raises(ValueError, match="no room for a context.*--kv-cache-dtype int8"):
        context_default.choose(None, cfg27b, world=2, dtype_bytes=2, kv_int8=False,
                               card=context_default.Card(capacity_bytes=V100_32GB / 2, held_bytes=held))


def test_a_card_with_room_serves_the_native_context(cfg27b):
    h200 = context_default.Card(capacity_bytes=143771 * 2**20, held_bytes=27.663e9, name="NVIDIA H200")
    ctx = context_default.choose(None, cfg27b, world=2, dtype_bytes=2, kv_int8=False, card=h200)
    assert ctx["max_context"] == 262144 and ctx["bound"] == "native" and ctx["fits"] > 262144


@pytest.fixture(scope="module")
def cfg27b(tmp_path_factory):
    d = tmp_path_factory.mktemp("cfg27b")
    (d / "config.json").write_text(CONFIG_27B.read_text())
    return engine_config.load(str(d))


svc = service_fixture(api_key="ctx-key-7a1")  # no --max-context


@pytest.mark.slow
def test_serve_without_max_context_serves_the_native_context(svc):
    health = svc.client.get("/health").json()
    assert health["context"]["max_context"] == 4096 and health["context"]["bound"] == "native"
    assert "native context (4096)" in health["context"]["why"]
    card = svc.client.get(f"/v1/models/{MODEL_ID}").json()
    assert card["max_model_len"] == 4096
    up = svc.events("ranks_up")
    assert up and up[-1]["max_context"] == 4096 and up[-1]["context"]["bound"] == "native"
    # No --max-concurrency on CPU: one request at a time, and /health and ranks_up say why
    # (tests/service/test_service_concurrency_default.py has the rule on a card)
    assert health["max_concurrency"] == 1 and health["concurrency"]["bound"] == "cpu"
    assert health["concurrency"]["max_concurrency"] == 1 and "on CPU" in health["concurrency"]["why"]
    assert up[-1]["max_concurrency"] == 1 and up[-1]["concurrency"]["bound"] == "cpu"
    rank_logs = [p.read_text() for p in Path(svc.state_dir).rglob("rank0.g*.log")]
    assert rank_logs and "context 4096 (bound native" in rank_logs[-1]
    # Past the rank's old 2048: a 3000-token prompt is served, one past 4096 positions is refused.
    r = svc.complete([5] * 3000, 8)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 3000
    r = svc.complete([5] * 4100, 8)
    assert r.status_code == 400 and "4096" in r.text
