"""The bundled engine's runtime reserve (memory a rank holds past its weights and K/V) comes from a recording of
the service at 256K positions on an H200 (tests/fixtures/engine/h200-long-context-27b16-256k-2026-12-02.json: the
27B hybrid shape cut to 16 layers, two ranks on the card, nvidia-smi sampled during the run), and the planner's
TP2 plan of that model then gives the recorded peak."""

from __future__ import annotations

import json

import pytest

from tests.paths import REPO
from v100plan import catalogue
from v100plan.planning import plan_document

REC = json.loads((REPO / "tests/fixtures/engine/h200-long-context-27b16-256k-2026-12-02.json").read_text())
PROFILE = catalogue.get("engine", "v100plan")


def _model(tmp_path, layers: int) -> str:
    raw = json.loads((REPO / "engine/data/qwen3.5-27b.config.json").read_text())
    raw["num_hidden_layers"] = layers
    raw.pop("layer_types", None)  # rebuilt from the full-attention interval, as the engine cuts a model
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path / "config.json")


def _tp2_memory(model: str) -> dict:
    doc = plan_document("h200", 2, model, "v100plan", "256K", None, 1, "latency", weights="bf16")
    (tp2,) = [s for s in doc["strategies"] if s["name"] == "tp2"]
    assert not [n for n in doc["notes"] if "runtime reserve unknown" in n]
    return tp2["breakdown"]["memory"]


def test_the_reserve_is_the_recorded_peak_less_the_planners_own_weights_and_kv(tmp_path):
    assert REC["layers"] == 16 and REC["max_context"] == 262144 and REC["devices"] == "cuda:0,cuda:0"
    mem = _tp2_memory(_model(tmp_path, 16))
    per_rank = REC["gpu_memory_used_mib"]["max"] * 2**20 / 2 / 1e9
    reserve = PROFILE["efficiency"]["runtime_reserve_gb"]
    assert reserve["value"] == pytest.approx(per_rank - mem["weights_gb"] - mem["kv_gb"], abs=0.01)
    assert mem["reserve_gb"] == reserve["value"]
    assert "h200-long-context-27b16-256k" in reserve["source"]
    # the planner's weights are the bytes a rank holds within 2 % (its /health), its K/V the cache's bytes
    held = REC["health_end"]["decode"]["0"]["weights"]["bytes"] / 1e9
    assert mem["weights_gb"] == pytest.approx(held, rel=0.02)
    assert mem["kv_gb"] == pytest.approx(4 * 2 * 256 * 2 * 2 * 262144 / 1e9, rel=0.01)  # 4 layers, 2 kv heads a rank
    assert 0.5 < reserve["value"] < 3.0  # a CUDA context, the allocator's slack, the 2 GiB prefix budget at most


def test_the_full_model_prediction_is_stated_for_the_next_run(tmp_path):
    mem = _tp2_memory(_model(tmp_path, 64))
    cal = {c["key"]: c for c in PROFILE["calibration"]}["memory_256k"]
    total = mem["weights_gb"] + mem["kv_gb"] + mem["reserve_gb"]
    assert f"{total:.2f} GB a rank" in cal["arithmetic"]
