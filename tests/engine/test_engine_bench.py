"""`v100plan bench engine`: the recorded H200 measurement becomes a valid EngineProfile whose numbers
follow from the bench JSON by the documented arithmetic; without a GPU the command says so."""

from __future__ import annotations

import json

import pytest

from tests.conftest import FIXTURES
from v100plan import documents
from v100plan.calibrate.single import best_variant, engine_profile

BENCH = FIXTURES / "engine" / "bench-h200-2026-11-29.json"


@pytest.fixture(scope="module")
def bench():
    return json.loads(BENCH.read_text())


def test_recorded_bench_is_an_h200_measurement(bench):
    assert bench["kind"] == "engine_bench" and "H200" in bench["device"]
    assert bench["weight_bytes"] > 14e9  # Llama-3.1-8B in bf16
    assert 3000 < bench["read_bw_gbps"] < 5000


def test_profile_is_valid_and_each_fraction_follows_from_the_bench(bench):
    doc = documents.validate(engine_profile(bench, "h200-test", str(BENCH)), "engine_profile")
    eff = doc["efficiency"]
    read = bench["read_bw_gbps"]
    assert eff["weight_bw_fraction"]["value"] == pytest.approx(bench["gemv"]["weight_gbps"] / read, abs=1e-4)
    v = best_variant(bench)
    assert eff["kv_bw_fraction"]["value"] == pytest.approx(bench["fit"][v]["kv_gbps"] / read, abs=1e-3)
    assert eff["round_overhead_ms"]["value"] == pytest.approx(
        bench["fit"][v]["intercept_ms"] - bench["gemv"]["ms"], abs=1e-3)
    assert eff["prefill_compute_fraction"]["value"] == pytest.approx(
        bench["prefill"]["tflops"] / bench["peak_tflops"], abs=1e-3)
    for item in eff.values():
        assert "H200" in item["source"]
    assert doc["status"] == "measured" and doc["speculative"]["draft_tokens"] == 0
    assert "ONE GPU" in doc["allreduce_source"]  # two ranks on one card: not two-card latencies
    assert "nccl" not in doc["allreduce_paths"]


def test_the_model_reproduces_the_measured_step_times(bench):
    """Planner arithmetic: weights / (f_w x bw) + K/V / (f_kv x bw) + overhead within 5 % of every step."""
    doc = engine_profile(bench)
    e = {k: v["value"] for k, v in doc["efficiency"].items()}
    bw = bench["read_bw_gbps"] * 1e9
    for ctx, m in bench["decode"][best_variant(bench)].items():
        gemv_bytes = bench["gemv"]["weight_bytes"]
        ms = (gemv_bytes / (e["weight_bw_fraction"] * bw) + m["kv_bytes"] / (e["kv_bw_fraction"] * bw)) * 1e3
        ms += e["round_overhead_ms"]
        assert ms == pytest.approx(m["ms"], rel=0.05), ctx


def test_cli_converts_a_recorded_bench(cli, tmp_path):
    out = tmp_path / "profile.json"
    r = cli("bench", "engine", "--from", str(BENCH), "--json", "--out", str(out))
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["kind"] == "engine_profile" and json.loads(out.read_text()) == doc
    assert "Engine decode, batch 1, TP1" in r.stderr  # tables go to stderr with --json


def test_cli_refuses_a_file_that_is_not_a_bench(cli, tmp_path):
    f = tmp_path / "x.json"
    f.write_text('{"kind": "plan"}')
    r = cli("bench", "engine", "--from", str(f))
    assert r.exit_code == 2 and "expected an engine_bench document, found kind 'plan'" in " ".join(r.stderr.split())


def test_cli_without_a_gpu_is_an_environment_problem(cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    r = cli("bench", "engine", "--quiet")
    assert r.exit_code == 4
    assert "needs a CUDA GPU" in r.stderr


def test_variant_without_a_usable_fit_is_not_used(bench):
    cdt = bench["fit"]["compiled_cdt_graph"]
    assert cdt["kv_bw_fraction"] is None and cdt["slope_ms_per_gb"] < 0  # time fell as the context grew
    assert best_variant(bench) == "eager_graph"


def test_recorded_runs_show_why_decode_attention_is_two_matrix_products(bench):
    """The same day's first run used the fused SDPA kernel for decode attention: K/V read at about 5 % of
    the read bandwidth. The matrix-product form in the engine now reads it several times faster."""
    sdpa = json.loads((FIXTURES / "engine" / "bench-h200-2026-11-29-sdpa.json").read_text())
    assert sdpa["fit"]["eager_graph"]["kv_bw_fraction"] < 0.1
    assert bench["fit"]["eager_graph"]["kv_bw_fraction"] > 0.3


def test_stored_profile_is_what_the_converter_writes(bench):
    """tests/fixtures/engine/engine-profile-h200-2026-11-29.json: `v100plan bench engine --from` of the bench."""
    stored = documents.load(FIXTURES / "engine" / "engine-profile-h200-2026-11-29.json", "engine_profile")
    fresh = engine_profile(bench, stored["id"])
    assert stored["efficiency"] == fresh["efficiency"]
    assert stored["allreduce_us"] == fresh["allreduce_us"]
