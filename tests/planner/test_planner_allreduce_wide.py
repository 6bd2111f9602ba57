"""Allreduces across more than two cards: priced from the box's own figures for that many cards
(the hardware profile's 'box', docs/field-figures.md), on the engine's own path (its profile's
allreduce_path) with NCCL's figures standing in where that path has none, else as log2(tp) two-card
allreduces, and the plan says which. Not timed; takes well under a second."""

from __future__ import annotations

import copy

import pytest

from tests.paths import REPO
from v100plan import catalogue, documents, plan_inputs
from v100plan.planner import Target, engine_from_doc, hardware_from_doc, plan
from v100plan.planner.allreduce import wide_allreduce

LLAMA2_7B = str(REPO / "profiles/published/configs/llama-2-7b.config.json")
LLAMA2_70B = str(REPO / "profiles/published/configs/llama-2-70b.config.json")


def _nccl_gptfast():
    """gpt-fast's profile as if its allreduces ran on NCCL (its published TP runs did not: allreduce_path)."""
    doc = copy.deepcopy(catalogue.get("engine", "gpt-fast"))
    del doc["allreduce_path"]
    return doc


def _plan(hw_doc, gpus, model_path, engine_doc=None, weights="bf16"):
    engine = engine_from_doc(engine_doc or _nccl_gptfast())
    model, alts = plan_inputs.load_model(model_path, weights, None, engine)
    return plan(hardware_from_doc(hw_doc, gpus), model, engine, Target(128, gpus), alternatives=alts), model


def _a100():
    return copy.deepcopy(catalogue.get("hardware", "a100-80gb"))


def test_a100_tp8_and_tp4_take_the_measured_figure_at_the_message_size():
    """Llama-2-70B (hidden 8192, bf16): one 16 KB message per allreduce, 2 per layer x 80 layers."""
    doc = _a100()
    table = doc["box"]["allreduce_us"]
    p, model = _plan(doc, 8, LLAMA2_70B)
    assert model.allreduce_bytes_per_token == 16384 and model.allreduces_per_round == 160
    d = p.strategy("tp8").breakdown["decode"]
    assert d["allreduce_us"] == table["8"]["nccl"]["16k"]
    assert d["allreduce_ms"] == pytest.approx(160 * table["8"]["nccl"]["16k"] / 1e3, abs=1e-3)
    assert "8-GPU figure on nccl" in d["allreduce_source"] and "ABCI" in d["allreduce_source"] and "job08" in d["allreduce_source"]
    assert p.strategy("tp4").breakdown["decode"]["allreduce_us"] == table["4"]["nccl"]["16k"]
    assert any(n.startswith("tp8: each allreduce priced from a100-80gb's 8-GPU figure on nccl") for n in p.notes)
    # No two-card A100 NCCL figure was published: tp2 on NCCL stays unpriced and the plan says so.
    assert p.strategy("tp2").breakdown["decode"]["allreduce_ms"] == 0
    assert any("no two-card figure for a100-80gb" in n and "4, 8-GPU figures" in n for n in p.notes)


def test_smaller_messages_cost_less_and_wider_boxes_cost_more():
    p7, m7 = _plan(_a100(), 8, LLAMA2_7B)
    p70, _ = _plan(_a100(), 8, LLAMA2_70B)
    assert m7.allreduce_bytes_per_token == 8192
    us7 = {n: p7.strategy(n).breakdown["decode"]["allreduce_us"] for n in ("tp4", "tp8")}
    assert us7["tp4"] < us7["tp8"] < p70.strategy("tp8").breakdown["decode"]["allreduce_us"]


def test_between_measured_sizes_the_figure_is_interpolated():
    doc = _a100()
    hw = hardware_from_doc(doc, 8)
    engine = engine_from_doc(_nccl_gptfast())
    t = doc["box"]["allreduce_us"]["8"]["nccl"]
    w = wide_allreduce(hw, engine, 8, 12 * 1024, None)
    assert w.measured and w.path == "nccl"
    assert w.us == pytest.approx((t["8k"] + t["16k"]) / 2)


def test_without_a_figure_for_that_count_log2_two_card_allreduces_stand_in():
    doc = _a100()
    del doc["box"]["allreduce_us"]["8"]
    doc["pair"]["allreduce_us"] = {"nccl": {"16k": 10.0}}
    doc["pair"]["sources"]["allreduce_us"] = "test figure"
    p, _ = _plan(doc, 8, LLAMA2_70B)
    d8 = p.strategy("tp8").breakdown["decode"]
    assert d8["allreduce_us"] == pytest.approx(30.0)            # log2(8) x 10 us
    assert "log2(8)" in d8["allreduce_source"]
    assert any(n.startswith("tp8: no 8-GPU allreduce figure") for n in p.notes)
    assert p.strategy("tp4").breakdown["decode"]["allreduce_us"] == doc["box"]["allreduce_us"]["4"]["nccl"]["16k"]
    assert p.strategy("tp2").breakdown["decode"]["allreduce_us"] == 10.0


def test_a_two_card_box_figure_prices_tp2_when_the_pair_has_none():
    doc = _a100()
    doc["box"]["allreduce_us"]["2"] = {"nccl": {"16k": 9.0}}
    doc["box"]["sources"]["2"] = "test figure"
    p, _ = _plan(doc, 2, LLAMA2_70B)
    d = p.strategy("tp2").breakdown["decode"]
    assert d["allreduce_us"] == 9.0 and d["allreduce_ms"] == pytest.approx(160 * 9.0 / 1e3, abs=1e-3)


def test_a_faster_box_figure_makes_the_plan_faster():
    """The figure is used, not just shown: halving it raises tp8's predicted speed."""
    slow, _ = _plan(_a100(), 8, LLAMA2_70B)
    doc = _a100()
    doc["box"]["allreduce_us"]["8"]["nccl"] = {k: v / 2 for k, v in doc["box"]["allreduce_us"]["8"]["nccl"].items()}
    fast, _ = _plan(doc, 8, LLAMA2_70B)
    assert fast.strategy("tp8").decode_tok_s > slow.strategy("tp8").decode_tok_s


def test_box_figures_are_validated_and_sourced():
    for hw_id in catalogue.ids("hardware"):
        doc = catalogue.get("hardware", hw_id)
        box = doc.get("box")
        if box:
            for n, tables in box["allreduce_us"].items():
                for path in tables:
                    src = box.get("path_sources", {}).get(path) or box["sources"].get(n)
                    assert src and len(src) > 40, (hw_id, n, path)
    bad = _a100()
    bad["box"]["allreduce_us"]["eight"] = {"nccl": {"16k": 28.6}}
    assert documents.problems(bad, "hardware_profile")
    bad = _a100()
    bad["box"]["allreduce_us"]["8"]["nccl"]["16k"] = -1
    assert documents.problems(bad, "hardware_profile")
    assert not documents.problems(_a100(), "hardware_profile")


def test_past_the_largest_measured_size_a_ring_moves_the_extra_bytes_at_the_links_bus_bandwidth():
    """Extra bytes go at bulk x n / 2(n-1) (nccl-tests' bus bandwidth relation), not in proportion to the table."""
    doc = _a100()
    doc["box"]["allreduce_us"]["8"] = {"nccl": {"8k": 20.0}}
    hw = hardware_from_doc(doc, 8)
    engine = engine_from_doc(_nccl_gptfast())
    bulk = hw.pair.bulk_gbps()
    assert bulk == doc["pair"]["link_bw_nominal_gbps"]
    extra = 1e6
    w = wide_allreduce(hw, engine, 8, 8192 + extra, None)
    assert w.us == pytest.approx(20.0 + extra / (bulk * 8 / 14 * 1e3))


def test_with_no_figure_at_all_the_plan_says_allreduces_are_not_priced():
    doc = _a100()
    del doc["box"]
    p, _ = _plan(doc, 8, LLAMA2_70B)
    assert p.strategy("tp8").breakdown["decode"]["allreduce_ms"] == 0
    assert any(n == "tp8: no 8-GPU or two-card allreduce figure for a100-80gb: allreduces not priced" for n in p.notes)
    assert not any("log2" in n for n in p.notes)


def test_an_engine_that_keeps_the_output_head_whole_reads_it_whole_on_every_rank():
    """gpt-fast's tp.py shards attention and MLP only: at tp8 each rank reads the whole head, not 1/8."""
    gptfast = plan_inputs.engine("gpt-fast")
    assert gptfast.tp_output_head == "replicated" and "tp.py" in gptfast.tp_output_head_source
    model, alts = plan_inputs.load_model(LLAMA2_7B, "bf16", None, gptfast)
    assert model.head_gb == pytest.approx(32000 * 4096 * 2 / 1e9, rel=1e-3)
    hw = hardware_from_doc(_a100(), 8)
    whole = plan(hw, model, gptfast, Target(128, 8), alternatives=alts)
    split_doc = copy.deepcopy(catalogue.get("engine", "gpt-fast"))
    split_doc["tp_output_head"]["value"] = "split"
    split = plan(hw, model, engine_from_doc(split_doc), Target(128, 8), alternatives=alts)
    for name, tp in (("tp2", 2), ("tp8", 8)):
        extra = whole.strategy(name).breakdown["decode"]["weights_read_gb"] - split.strategy(name).breakdown["decode"]["weights_read_gb"]
        assert extra == pytest.approx(model.head_gb * (1 - 1 / tp), abs=2e-3)
    assert whole.strategy("single").decode_tok_s == split.strategy("single").decode_tok_s
    assert any("keeps the output head whole on every rank" in n for n in whole.notes)
    assert not any("keeps the output head whole" in n for n in split.notes)
