"""Each engine's allreduces are priced on the path they actually run (the engine profile's
allreduce_path): gpt-fast's published tensor-parallel runs used PyTorch's intra-node kernels
(ENABLE_INTRA_NODE_COMM=1), not NCCL. The box's figures for that path price it; where the box has
none, or the path cannot run on the card, NCCL's figures stand in and the plan says so.
Not timed; takes well under a second."""

from __future__ import annotations

import copy

import pytest

from tests.paths import REPO
from v100plan import catalogue, documents, plan_inputs
from v100plan import plan_accuracy as accuracy
from v100plan.planner import Target, engine_from_doc, hardware_from_doc, plan
from v100plan.planner.allreduce import path_problem, wide_allreduce

LLAMA2_7B = str(REPO / "profiles/published/configs/llama-2-7b.config.json")
LLAMA2_70B = str(REPO / "profiles/published/configs/llama-2-70b.config.json")
INTRA = "torch_intra_node"


def _doc(kind, id_):
    return copy.deepcopy(catalogue.get(kind, id_))


def _plan(hw_doc, gpus, model_path, engine_doc=None, weights="bf16"):
    engine = engine_from_doc(engine_doc or _doc("engine", "gpt-fast"))
    model, alts = plan_inputs.load_model(model_path, weights, None, engine)
    return plan(hardware_from_doc(hw_doc, gpus), model, engine, Target(128, gpus), alternatives=alts)


def test_gpt_fast_names_its_path_and_where_it_read_it():
    engine = engine_from_doc(_doc("engine", "gpt-fast"))
    assert engine.allreduce_path == INTRA
    assert "ENABLE_INTRA_NODE_COMM=1" in engine.allreduce_path_source and "c5d3454" in engine.allreduce_path_source
    # Every other catalogued engine runs NCCL (or chooses among its own paths): the default.
    for eid in catalogue.ids("engine"):
        if eid != "gpt-fast":
            assert engine_from_doc(_doc("engine", eid)).allreduce_path == "nccl", eid


def test_gpt_fast_on_the_a100_is_priced_on_its_own_path_at_every_width():
    """tp2, tp4 and tp8 take the box's torch_intra_node figure (not the slower NCCL one it also has)."""
    hw_doc = _doc("hardware", "a100-80gb")
    box = hw_doc["box"]
    p = _plan(hw_doc, 8, LLAMA2_7B)
    for name, n in (("tp2", "2"), ("tp4", "4"), ("tp8", "8")):
        s = p.strategy(name)
        d = s.breakdown["decode"]
        assert s.allreduce_path == INTRA, name
        assert d["allreduce_us"] == box["ranges"][INTRA]["used_us"], name      # flat table: 8 B to 256 KB
        assert d["allreduce_ms"] == pytest.approx(64 * d["allreduce_us"] / 1e3, abs=1e-3)
        assert "#114001" in d["allreduce_source"] and "ENABLE_INTRA_NODE_COMM" in d["allreduce_source"], name
        if n != "2":
            assert d["allreduce_us"] < box["allreduce_us"][n]["nccl"]["8k"]
    assert any(n.startswith(f"tp8: each allreduce priced from a100-80gb's 8-GPU figure on {INTRA}") for n in p.notes)
    assert not any("stand in" in n for n in p.notes)


def test_the_path_decides_the_price_for_the_same_engine_and_box():
    """The same gpt-fast profile on NCCL pays the nccl-tests figure and predicts a slower tp8."""
    nccl_doc = _doc("engine", "gpt-fast")
    del nccl_doc["allreduce_path"]
    own = _plan(_doc("hardware", "a100-80gb"), 8, LLAMA2_7B)
    nccl = _plan(_doc("hardware", "a100-80gb"), 8, LLAMA2_7B, nccl_doc)
    assert nccl.strategy("tp8").allreduce_path == "nccl"
    assert own.strategy("tp8").decode_tok_s > nccl.strategy("tp8").decode_tok_s


def test_without_the_paths_figure_for_that_count_nccls_stands_in_and_the_plan_says_so():
    hw_doc = _doc("hardware", "a100-80gb")
    del hw_doc["box"]["allreduce_us"]["8"][INTRA]
    p = _plan(hw_doc, 8, LLAMA2_70B)
    d8 = p.strategy("tp8").breakdown["decode"]
    assert p.strategy("tp8").allreduce_path == "nccl"
    assert d8["allreduce_us"] == hw_doc["box"]["allreduce_us"]["8"]["nccl"]["16k"]
    assert f"no 8-GPU {INTRA} figure for a100-80gb" in d8["allreduce_source"]
    assert "NCCL's figures stand in" in d8["allreduce_source"]
    note = next(n for n in p.notes if n.startswith("tp8:"))
    assert "on nccl" in note and "stand in" in note
    # tp4 still has its own path's figure.
    assert p.strategy("tp4").allreduce_path == INTRA


def test_a_box_without_the_path_falls_back_to_nccl_visibly():
    """The H100 profile has an 8-GPU NCCL table only: gpt-fast's tp8 there is priced from it, said in the plan."""
    h100 = _doc("hardware", "h100-sxm")
    engine = engine_from_doc(_doc("engine", "gpt-fast"))
    w = wide_allreduce(hardware_from_doc(h100, 8), engine, 8, 16384, None)
    assert w.path == "nccl" and w.measured
    assert "no 8-GPU torch_intra_node figure for h100-sxm" in w.source and "NCCL's figures stand in" in w.source
    p = _plan(h100, 8, LLAMA2_70B)
    note = next(n for n in p.notes if n.startswith("tp8:"))
    assert "8-GPU figure on nccl" in note and "NCCL's figures stand in" in note
    assert any(n.startswith("allreduce: engine gpt-fast uses torch_intra_node (NCCL where that cannot run)") for n in p.notes)


def test_the_path_cannot_run_below_ampere_or_without_nvlink():
    """PyTorch's kernels need sm_80+ and NVLink (intra_node_comm.cu/.cpp); elsewhere the call goes to NCCL."""
    hw_doc = _doc("hardware", "a100-80gb")
    hw_doc["compute_capability"] = "7.0"
    assert "compute capability 8.0" in path_problem(INTRA, hardware_from_doc(hw_doc, 8))
    hw_doc = _doc("hardware", "a100-80gb")
    hw_doc["pair"]["interconnect"] = "pcie"
    assert "NVLink" in path_problem(INTRA, hardware_from_doc(hw_doc, 8))
    assert path_problem(INTRA, hardware_from_doc(_doc("hardware", "a100-80gb"), 8)) is None
    # With the figure present but the path impossible, NCCL's figure prices tp8, and the source says why.
    engine = engine_from_doc(_doc("engine", "gpt-fast"))
    hw_doc = _doc("hardware", "a100-80gb")
    hw_doc["pair"]["interconnect"] = "pcie"
    w = wide_allreduce(hardware_from_doc(hw_doc, 8), engine, 8, 8192, None)
    assert w.path == "nccl" and "needs NVLink" in w.source and w.us == hw_doc["box"]["allreduce_us"]["8"]["nccl"]["8k"]


def test_a_ranged_source_holds_its_midpoint_and_says_so():
    """The source gives a range ('between 6-15us'), not a table: the tables hold the midpoint, the range's
    ends are kept with their source, and the schema refuses a range without one."""
    box = _doc("hardware", "a100-80gb")["box"]
    rng = box["ranges"][INTRA]
    assert (rng["low_us"], rng["high_us"]) == (6.0, 15.0)
    assert rng["used_us"] == pytest.approx((rng["low_us"] + rng["high_us"]) / 2)
    assert "midpoint" in rng["sources"]["used_us"] and "#131739" in rng["sources"]["low_us"]
    for n in ("2", "4", "8"):
        assert set(box["allreduce_us"][n][INTRA].values()) == {rng["used_us"]}, n
    bad = _doc("hardware", "a100-80gb")
    del bad["box"]["ranges"][INTRA]["sources"]
    assert documents.problems(bad, "hardware_profile")


def test_the_ends_of_the_range_bracket_the_prediction():
    """at_range_end scales the ranged figures only: the low end predicts gpt-fast's tp8 faster, the high end
    slower, and NCCL-priced engines and figures do not move."""
    hw_doc = _doc("hardware", "a100-80gb")
    low, high = accuracy.at_range_end(hw_doc, "low"), accuracy.at_range_end(hw_doc, "high")
    assert set(low["box"]["allreduce_us"]["8"][INTRA].values()) == {6.0}
    assert set(high["box"]["allreduce_us"]["8"][INTRA].values()) == {15.0}
    assert low["box"]["allreduce_us"]["8"]["nccl"] == hw_doc["box"]["allreduce_us"]["8"]["nccl"]
    tok = {k: _plan(d, 8, LLAMA2_7B).strategy("tp8").decode_tok_s for k, d in (("low", low), ("mid", hw_doc), ("high", high))}
    assert tok["low"] > tok["mid"] > tok["high"]
    with pytest.raises(ValueError):
        accuracy.at_range_end(hw_doc, "middle")
