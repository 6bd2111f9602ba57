"""The bundled engine's runtime reserve (memory a rank holds past its weights and K/V) comes from a recording of
the service at 256K positions on an H200 (tests/fixtures/engine/h200-long-context-27b-256k-2026-12-04-memory.json:
the full 64-layer 27B hybrid shape, two ranks on the card, the bench's nvidia-smi sampler), so the planner's TP2
plan of that model gives the recorded peak; the 16-layer cut's recording (2026-12-02) is then planned on the safe
side (more memory than it used, never less)."""

from __future__ import annotations

import json

import pytest

from tests.paths import REPO
from v100plan import catalogue
from v100plan.planning import plan_document

FIX = REPO / "tests/fixtures/engine"
FULL = json.loads((FIX / "h200-long-context-27b-256k-2026-12-04-memory.json").read_text())
CUT = json.loads((FIX / "h200-long-context-27b16-256k-2026-12-02.json").read_text())
PROFILE = catalogue.get("engine", "v100plan")


def _model(tmp_path, layers: int) -> str:
    raw = json.loads((REPO / "engine/data/qwen3.5-27b.config.json").read_text())
    raw["num_hidden_layers"] = layers
    raw.pop("layer_types", None)  # rebuilt from the full-attention interval, as the engine cuts a model
    (tmp_path / f"config{layers}.json").write_text(json.dumps(raw))
    return str(tmp_path / f"config{layers}.json")


def _tp2_memory(model: str) -> dict:
    doc = plan_document("h200", 2, model, "v100plan", "256K", None, 1, "latency", weights="bf16")
    (tp2,) = [s for s in doc["strategies"] if s["name"] == "tp2"]
    assert not [n for n in doc["notes"] if "runtime reserve unknown" in n]
    return tp2["breakdown"]["memory"]


def _per_rank_gb(rec: dict) -> float:
    return rec["gpu_memory_used_mib"]["max"] * 2**20 / 2 / 1e9  # two ranks on the one card


def _check_run(rec: dict, layers: int) -> None:
    assert rec["layers"] == layers and rec["max_context"] == 262144 and rec["devices"] == "cuda:0,cuda:0"
    assert rec["completed"] and rec["last_position"] == 262143  # the context was filled: its memory is the peak
    assert rec["gpu_memory_used_mib"]["samples"] >= 10


def test_the_reserve_is_the_full_models_recorded_peak_less_the_planners_own_weights_and_kv(tmp_path):
    _check_run(FULL, 64)
    mem = _tp2_memory(_model(tmp_path, 64))
    reserve = PROFILE["efficiency"]["runtime_reserve_gb"]
    assert reserve["value"] == pytest.approx(_per_rank_gb(FULL) - mem["weights_gb"] - mem["kv_gb"], abs=0.01)
    assert mem["reserve_gb"] == reserve["value"]
    assert "h200-long-context-27b-256k-2026-12-04-memory" in reserve["source"]
    # the planner's weights are the bytes a rank holds within 2 % (its /health), its K/V the cache's bytes
    held = FULL["health_end"]["decode"]["0"]["weights"]["bytes"] / 1e9
    assert mem["weights_gb"] == pytest.approx(held, rel=0.02)
    assert mem["kv_gb"] == pytest.approx(16 * 2 * 256 * 2 * 2 * 262144 / 1e9, rel=0.01)  # 16 layers, 2 kv heads a rank
    assert 1.0 < reserve["value"] < 5.0  # a CUDA context, the allocator's slack, the 2 GiB prefix budget at most, MTP
    total = mem["weights_gb"] + mem["kv_gb"] + mem["reserve_gb"]
    assert total == pytest.approx(_per_rank_gb(FULL), rel=0.005)


def test_the_16_layer_cut_is_planned_on_the_safe_side_and_says_by_how_much(tmp_path):
    _check_run(CUT, 16)
    mem = _tp2_memory(_model(tmp_path, 16))
    total = mem["weights_gb"] + mem["kv_gb"] + mem["reserve_gb"]
    measured = _per_rank_gb(CUT)
    assert measured < total < 1.15 * measured  # more than it used (less context fits), by under 15 %
    cal = {c["key"]: c for c in PROFILE["calibration"]}["memory_256k"]
    assert f"{total:.2f} GB a rank" in cal["arithmetic"] and f"{measured:.2f} GB a rank" in cal["arithmetic"]
