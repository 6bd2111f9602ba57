"""Decode variants (`python -m engine bench --variants`): the one decode step (Model.decode_step) computes
what the prefill path computes, its compiled blocks trace whole, the correctness check rejects NaN and drift, the CPU dry run covers every
variant, and the recorded H200 runs are judged: every variant correct or failed with its reason, and
each ratio follows from the same run's read bandwidth."""

from __future__ import annotations

import json

import pytest

from tests.conftest import FIXTURES
from tests.engine_helpers import random_small_model, small_config

RECORDED = FIXTURES / "engine" / "h200-decode-variants-2026-11-29.json"
# The first run of the day judged against the eager bf16 step with a fixed 5 % bar: every compiled
# variant, the existing compiled step included, differed by 6-7 %, so none was timed (kept as evidence
# for the float32 reference the bench uses now).
RECORDED_STRICT = FIXTURES / "engine" / "h200-decode-variants-2026-11-29-vs-eager-bf16.json"


def _model(name: str):
    return random_small_model(name, 256)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-8b", "qwen2.5-0.5b"])
def test_decode_step_matches_the_prefill_forward(name):
    """The one decode step (block by block, additive mask, residual add moved into the next block)
    computes what the prefill path computes for the same position, and writes the same K/V."""
    import torch

    model = _model(name)
    tok, pos = torch.tensor([5]), torch.tensor([37])
    with torch.inference_mode():
        want = model.forward(tok.view(1, 1), 37)  # [V]: attends over cache positions 0..37
        k_want = model.layers[1].k_cache[:, :, 37].clone()
        model.layers[1].k_cache[:, :, 37] = 0  # the step must write it again
        got = model.decode_step(tok, pos, 256)
    assert got.shape == want.shape == (model.cfg.vocab_size,)
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert torch.allclose(model.layers[1].k_cache[:, :, 37], k_want, atol=1e-5)


def test_compiled_blocks_trace_as_one_graph_each():
    """fullgraph=True: a graph break would raise; each block compiles once for all layers."""
    import torch

    from engine.core.model import attn_block, mlp_block

    model = _model("qwen3-8b")
    tok, pos = torch.tensor([3]), torch.tensor([12])
    blocks = tuple(torch.compile(f, fullgraph=True, dynamic=False, backend="eager") for f in (attn_block, mlp_block))
    with torch.inference_mode():
        want = model.decode_step(tok, pos, 256)
        got = model.decode_step(tok, pos, 256, blocks)
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_check_rejects_nan_and_drift_and_passes_rounding():
    import torch

    from engine.bench.variants import check

    ref = torch.randn(1000)
    assert check(ref + 1e-4 * torch.randn(1000), ref, 0.01)["correct"]
    drift = check(ref * 1.1, ref, 0.01)
    assert not drift["correct"] and "relative error" in drift["reason"]
    bad = ref.clone()
    bad[3] = float("nan")
    nan = check(bad, ref, 10.0)  # a NaN fails under any tolerance
    assert not nan["correct"] and nan["reason"] == "non-finite logits" and nan["rel_err"] is None


def test_cpu_dry_run_covers_every_variant(tmp_path, capsys):
    from engine.bench import decode as bench
    from engine.bench import variants as bench_variants

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(small_config("llama-3.1-8b")))
    out = tmp_path / "variants.json"
    rc = bench.main(["--variants", "--config", str(cfg), "--device", "cpu", "--backend", "eager", "--context", "40",
                     "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == doc
    assert [k for k in doc["variants"]] == [v[0] for v in bench_variants.VARIANTS]
    for name, row in doc["variants"].items():
        assert row["status"] == "passed" and row["correct"], name
        assert row["rel_err"] <= doc["reference"]["tolerance_rel"]
    assert doc["read_bw_gbps"] is None and "not a speed measurement" in doc["method"]


@pytest.fixture(scope="module")
def recorded():
    return json.loads(RECORDED.read_text())


def test_recorded_run_is_the_h200_llama_8b_step(recorded):
    assert recorded["kind"] == "engine_bench_variants" and recorded["device"] == "NVIDIA H200"
    assert recorded["num_layers"] == 32 and recorded["dtype"] == "bfloat16" and recorded["context"] == 512
    assert recorded["weight_bytes"] > 14e9
    assert 3000 < recorded["read_bw_gbps"] < 5000  # measured in the same run
    floor = recorded["weight_bytes"] / (recorded["read_bw_gbps"] * 1e9) * 1e3
    assert recorded["floor_ms"] == pytest.approx(floor, abs=1e-3)
    assert recorded["target_80_ms"] == pytest.approx(floor / 0.8, abs=1e-3)


def test_every_recorded_variant_is_correct_or_failed_with_a_reason(recorded):
    ref = recorded["reference"]
    assert ref["tolerance_rel"] == pytest.approx(
        max(ref["tolerance_factor"] * ref["eager_rel_err"], ref["tolerance_floor"]), abs=1e-5)
    assert {"eager_graph", "compiled_graph"} <= set(recorded["variants"])
    for name, row in recorded["variants"].items():
        assert row["predicted_ms"] > 0 and row["prediction"], name
        if row["status"] == "passed":
            assert row["finite"] and row["correct"] and row["rel_err"] <= ref["tolerance_rel"], name
        else:
            assert row["status"] in ("failed", "skipped") and row["reason"], name


def test_recorded_ratios_use_the_same_run_read_bandwidth(recorded):
    read = recorded["read_bw_gbps"]
    timed = {k: v for k, v in recorded["variants"].items() if v["status"] == "passed"}
    assert len(timed) >= 2
    for name, row in timed.items():
        gbps = recorded["weight_bytes"] / (row["ms"] * 1e-3) / 1e9
        assert row["weight_gbps"] == pytest.approx(gbps, abs=0.2), name
        assert row["read_bw_fraction"] == pytest.approx(gbps / read, abs=1e-4), name
        assert row["tok_s"] == pytest.approx(1000 / row["ms"], abs=0.01), name
    best = min(timed, key=lambda k: timed[k]["ms"])
    assert recorded["best"] == best
    assert recorded["target_80_reached"] == (timed[best]["ms"] <= recorded["target_80_ms"])
    # The figures docs/engine.md quotes: 80 % not reached; compiling beats the eager graph by > 25 %.
    assert recorded["target_80_reached"] is False
    assert timed[best]["ms"] < 0.75 * timed["eager_graph"]["ms"]


def test_strict_first_run_failed_every_compiled_variant_with_its_reason():
    doc = json.loads(RECORDED_STRICT.read_text())
    assert doc["variants"]["eager_graph"]["status"] == "passed"
    for name, row in doc["variants"].items():
        if name != "eager_graph":
            assert row["status"] == "failed" and "relative error" in row["reason"] and "ms" not in row, name
            assert 0.05 < row["rel_err"] < 0.08, name  # bf16 rounding over 32 layers, never NaN
