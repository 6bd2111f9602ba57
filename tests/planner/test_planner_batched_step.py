"""The bundled engine decodes several sequences in one batched step (serve --max-concurrency N > 1), and the plan
prices a round of C sequences as the one-sequence round x the step's measured ratio (v100plan/planner/batch_step.py).

The expected figures are worked out here from the bench's milliseconds as docs/engine-speed.md writes them up
(python -m engine.bench.concurrency, one H100, the 27B hybrid shape: bf16 in '2026-12-06 (night), nvidia-h100-x1 ...
the batched step on the kernels', int4 in '2026-12-06, nvidia-h100-x1 ... house check and batching'), not read back
from the engine profile.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import pytest

from v100plan import plan_inputs
from v100plan.planner import Target
from v100plan.planner.plan import plan_strategies
from v100plan.planning import load_engine, load_hardware, plan_document

# docs/engine-speed.md, 2026-12-06: the one-sequence step ("solo") and the batched step for C sequences, in ms
BF16_4K_SOLO, BF16_4K = 19.83, {1: 22.75, 2: 23.26, 4: 23.94, 8: 25.30, 16: 28.53}
INT4_4K_SOLO, INT4_4K = 8.37, {1: 19.71, 2: 39.76, 4: 43.26, 8: 51.34, 16: 67.35}

HW, MODEL = "h200", "qwen3.5-27b"  # one card that holds the 27B in bf16


def _plan(c: int, context: str = "4K", weights: str = "bf16", draft_tokens: int | None = 0) -> dict:
    return plan_document(HW, 1, MODEL, "v100plan", context, None, c, "latency", weights=weights,
                         draft_tokens=draft_tokens)


def _single(doc: dict) -> dict:
    return next(s for s in doc["strategies"] if s["name"] == "single")


def _r4(c: float) -> float:
    """The bf16 4K step ratio, linear between the measured counts (the line through 8 and 16 beyond them)."""
    xs = sorted(BF16_4K)
    if c > xs[-1]:
        a, b = xs[-2], xs[-1]
    else:
        a, b = max(x for x in xs if x <= c), min(x for x in xs if x >= c)
    if a == b:
        return BF16_4K[a] / BF16_4K_SOLO
    ms = BF16_4K[a] + (BF16_4K[b] - BF16_4K[a]) * (c - a) / (b - a)
    return ms / BF16_4K_SOLO


def test_eight_sequences_at_4k_run_at_the_measured_batched_step_over_the_solo_step():
    one, eight = _single(_plan(1)), _single(_plan(8))
    assert one["fits"] and eight["fits"]
    per_request = one["decode_tok_s"] / (BF16_4K[8] / BF16_4K_SOLO)
    assert eight["decode_tok_s"] == pytest.approx(per_request, rel=1e-3)
    assert eight["aggregate_tok_s"] == pytest.approx(8 * eight["decode_tok_s"], rel=1e-3)
    assert eight["round_ms"] == pytest.approx(one["round_ms"] * BF16_4K[8] / BF16_4K_SOLO, rel=1e-3)
    d = eight["breakdown"]["decode"]
    assert d["batch_step_how"] == "measured" and d["batch_step_family"] == "bf16"
    assert "docs/engine-speed.md" in d["batch_step_source"] and "H100" in d["batch_step_source"]
    # the ceilings stay physical: weights read once for all eight, each sequence's K/V; the round is far above
    assert eight["decode_ceiling_tok_s"] < one["decode_ceiling_tok_s"]
    assert eight["decode_ceiling_tok_s"] > one["decode_ceiling_tok_s"] / 1.5  # not divided by the step ratio
    assert eight["aggregate_ceiling_tok_s"] == pytest.approx(8 * eight["decode_ceiling_tok_s"], rel=1e-3)


def test_a_count_between_measured_ones_is_interpolated_and_one_past_16_extrapolated():
    one = _single(_plan(1))["decode_tok_s"]
    two, three, four = (_single(_plan(c)) for c in (2, 3, 4))
    assert three["decode_tok_s"] == pytest.approx(one / _r4(3), rel=1e-3)
    assert two["decode_tok_s"] > three["decode_tok_s"] > four["decode_tok_s"]
    assert three["breakdown"]["decode"]["batch_step_how"] == "interpolated"
    doc = _plan(32)
    big = _single(doc)
    want = (BF16_4K[16] + (BF16_4K[16] - BF16_4K[8]) * 2) / BF16_4K_SOLO  # the line through C = 8 and 16, at 32
    assert want == pytest.approx(_r4(32))
    assert big["decode_tok_s"] == pytest.approx(one / want, rel=1e-3)
    assert big["breakdown"]["decode"]["batch_step_how"] == "extrapolated"
    assert "C = 32 extrapolated linearly from C = 8 and 16" in big["breakdown"]["decode"]["batch_step_basis"]
    assert any("extrapolated" in n and "batched step" in n for n in doc["notes"])


def test_one_sequence_plans_are_the_solo_step_as_before():
    hw, engine = load_hardware(HW, 1), load_engine("v100plan")
    model, _ = plan_inputs.load_model(MODEL, "bf16", None, engine, None, 0)
    target = Target(context_tokens=4096, gpus=1, concurrency=1, draft_tokens=0)
    with_table = plan_strategies(hw, model, engine, target).strategy("single")
    without = plan_strategies(hw, model, replace(engine, batched_step=None), target).strategy("single")
    assert engine.batched_step is not None
    assert with_table.decode_tok_s == without.decode_tok_s and with_table.round_ms == without.round_ms
    assert "batch_step_ratio" not in with_table.breakdown["decode"]
    # and for C > 1 the table is what prices the round: the arithmetic alone (weights once, eight sequences' K/V)
    # would be faster than the measured step
    eight = replace(target, concurrency=8)
    assert (plan_strategies(hw, model, engine, eight).strategy("single").decode_tok_s
            < 0.95 * plan_strategies(hw, model, replace(engine, batched_step=None), eight).strategy("single").decode_tok_s)


def test_an_engine_whose_profile_caps_concurrency_still_refuses_more():
    hw, engine = load_hardware(HW, 1), load_engine("v100plan")
    capped = replace(engine, max_concurrency=2)
    model, _ = plan_inputs.load_model(MODEL, "bf16", None, engine, None, 0)
    res = plan_strategies(hw, model, capped, Target(context_tokens=4096, gpus=1, concurrency=4, draft_tokens=0))
    assert not any(r.fits for r in res.strategies)
    assert all("decodes at most 2 sequence(s) at once: 4 concurrent requests would queue" in r.reason
               for r in res.strategies)
    assert plan_strategies(hw, model, capped, Target(context_tokens=4096, gpus=1, concurrency=2,
                                                     draft_tokens=0)).strategy("single").fits


def test_more_sequences_than_the_card_holds_still_fail_on_memory():
    fit = _single(_plan(1, "64K"))["breakdown"]["memory"]["sequences_that_fit"]
    assert 1 < fit < 64
    assert _single(_plan(fit, "64K"))["fits"]
    over = _single(_plan(fit + 1, "64K"))
    assert not over["fits"] and "per GPU" in over["reason"]


def test_int4_weights_take_the_int4_ratios_held_at_every_context():
    one, eight = _single(_plan(1, weights="int4-gptq")), _single(_plan(8, weights="int4-gptq"))
    assert eight["decode_tok_s"] == pytest.approx(one["decode_tok_s"] / (INT4_4K[8] / INT4_4K_SOLO), rel=1e-3)
    assert eight["breakdown"]["decode"]["batch_step_family"] == "int4"
    far1, far8 = _single(_plan(1, "64K", "int4-gptq")), _single(_plan(8, "64K", "int4-gptq"))
    assert far8["decode_tok_s"] == pytest.approx(far1["decode_tok_s"] / (INT4_4K[8] / INT4_4K_SOLO), rel=1e-3)
    d = far8["breakdown"]["decode"]
    assert d["batch_step_how"] == "extrapolated" and "only 4K measured for int4" in d["batch_step_basis"]


def test_bf16_measured_at_4k_only_holds_its_4k_ratios_at_64k_and_says_so():
    at64, eight = _single(_plan(1, "64K")), _single(_plan(8, "64K"))
    assert eight["decode_tok_s"] == pytest.approx(at64["decode_tok_s"] / (BF16_4K[8] / BF16_4K_SOLO), rel=1e-3)
    d = eight["breakdown"]["decode"]
    assert d["batch_step_how"] == "extrapolated" and "only 4K measured for bf16" in d["batch_step_basis"]
    assert "likely optimistic" in d["batch_step_basis"]


def test_two_measured_contexts_add_the_long_rows_increment_in_log2_context():
    """The interpolation in context, on a table given a 64K row of its own (ratios 1.5 at C = 1 and 2.0 at C = 4:
    inputs of this test, not measurements): the 64K row's increment over 4K is a fixed part (C = 1) and a part per
    row (C = 4 against C = 1), linear in C, applied in log2(context)."""
    from v100plan.planner.inputs import BatchedStep, BatchedStepFamily, BatchedStepRow

    hw, engine = load_hardware(HW, 1), load_engine("v100plan")
    model, _ = plan_inputs.load_model(MODEL, "bf16", None, engine, None, 0)
    fam = engine.batched_step.family_for("bf16")
    long = BatchedStepRow(65536, 20.0, {1: 30.0, 4: 40.0})
    table = BatchedStep("test", "test", (BatchedStepFamily(fam.name, fam.formats, (fam.rows[0], long)),))
    eng = replace(engine, batched_step=table)
    d1, d4 = 1.5 - BF16_4K[1] / BF16_4K_SOLO, 2.0 - BF16_4K[4] / BF16_4K_SOLO

    def ratio(c: int, ctx: int) -> float:
        t = math.log2(ctx / 4096) / 4
        return _r4(c) + t * (d1 + (c - 1) * (d4 - d1) / 3)

    def single(c: int, ctx: int):
        return plan_strategies(hw, model, eng, Target(context_tokens=ctx, gpus=1, concurrency=c,
                                                      draft_tokens=0)).strategy("single")

    at64 = single(1, 65536).decode_tok_s
    four = single(4, 65536)
    assert four.decode_tok_s == pytest.approx(at64 / 2.0, rel=1e-3)
    assert four.breakdown["decode"]["batch_step_how"] == "measured"
    two = single(2, 65536)
    assert two.decode_tok_s == pytest.approx(at64 / ratio(2, 65536), rel=1e-3)
    assert two.breakdown["decode"]["batch_step_how"] == "interpolated"
    r16 = single(8, 16384).breakdown["decode"]
    assert r16["batch_step_ratio"] == pytest.approx(ratio(8, 16384), abs=1e-4)
    assert r16["batch_step_how"] == "extrapolated"  # C = 8 past 4 at 64K
    far = single(4, 131072).breakdown["decode"]
    assert far["batch_step_ratio"] == pytest.approx(ratio(4, 131072), abs=1e-4)
    assert far["batch_step_how"] == "extrapolated" and "beyond the 4K and 64K rows" in far["batch_step_basis"]


def _pair(c: int, draft_tokens: int | None) -> dict:
    """The default V100 pair (tp2 fits, its allreduces priced) with the 27B's int4 weights at 4K."""
    return plan_document("v100-pg500-216", 2, MODEL, "v100plan", "4K", None, c, "latency", weights="int4-gptq",
                         draft_tokens=draft_tokens)


def test_a_pair_prices_the_one_sequence_round_with_its_own_allreduces():
    one, eight = ({s["name"]: s for s in _pair(c, 0)["strategies"] if s["fits"]} for c in (1, 8))
    assert {"single", "tp2"} <= set(eight)
    for name, s in eight.items():
        assert s["decode_tok_s"] == pytest.approx(one[name]["decode_tok_s"] / (INT4_4K[8] / INT4_4K_SOLO), rel=1e-3), name
        assert s["breakdown"]["decode"]["allreduce_ms"] == one[name]["breakdown"]["decode"]["allreduce_ms"]


def test_speculating_sequences_take_their_rounds_in_turn():
    one, doc = _single(_plan(1, draft_tokens=None)), _plan(4, draft_tokens=None)
    four = _single(doc)
    assert doc["inputs"]["draft_tokens"] > 0
    assert four["aggregate_tok_s"] == pytest.approx(one["decode_tok_s"], rel=1e-3)
    assert four["decode_tok_s"] == pytest.approx(one["decode_tok_s"] / 4, rel=1e-3)
    assert four["breakdown"]["decode"]["rounds_in_turn"] == 4
    solo, many = ({s["name"]: s for s in _pair(c, None)["strategies"] if s["fits"]} for c in (1, 3))
    assert "tp2" in many
    for name, s in many.items():  # every strategy, tp2's allreduces included: three rounds of one sequence in turn
        assert s["aggregate_tok_s"] == pytest.approx(solo[name]["aggregate_tok_s"], rel=1e-3), name
        assert s["decode_tok_s"] == pytest.approx(solo[name]["decode_tok_s"] / 3, rel=1e-3), name
    assert any("does not batch speculating sequences" in n and "upper bound" in n
               and "eager per-slot round's extra cost" in n and "not measured" in n for n in doc["notes"])


def test_the_launch_line_serves_the_sequences_the_plan_priced():
    from engine.service import serve_config

    parser = argparse.ArgumentParser()
    serve_config.add_serve_arguments(parser)
    argv = _plan(8)["launch"]["commands"][0]["argv"]
    assert argv[:4] == ["python", "-m", "engine", "serve"] and parser.parse_args(argv[4:]).max_concurrency == 8
    assert "--max-concurrency" not in " ".join(_plan(1)["launch"]["commands"][0]["argv"])  # serve's default as before
    doc = _plan(8)
    assert any("--no-batch-graphs" in n and "eagerly" in n for n in doc["notes"])
