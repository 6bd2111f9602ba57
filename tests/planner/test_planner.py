"""The planner's formulas, its rules (allreduce path, fit, nearest fit) and its contract over the whole catalogue."""

from __future__ import annotations

import time

import pytest

from tests.planner.test_planner_facts import K, plan_ids
from v100plan import catalogue, plan_inputs
from v100plan.planner import Target, engine_from_doc, hardware_from_doc, model_from_doc, plan
from v100plan.planner.allreduce import latency_us_at, size_key_bytes
from v100plan.planner.decode import tokens_per_round
from v100plan.planner.from_probe import hardware_from_probe
from v100plan.planner.strategies import kv_share_tp2

HARDWARE = catalogue.ids("hardware")
MODELS = catalogue.ids("model")
FIXTURES = "tests/fixtures/probes"


def test_tokens_per_round():
    assert tokens_per_round(3, 0.0) == 1.0
    assert tokens_per_round(3, 0.745) == pytest.approx(3.235)


def test_size_keys_and_latency_interpolation():
    assert size_key_bytes("40k") == 40960 and size_key_bytes("1m") == 1048576 and size_key_bytes("fast") is None
    table = {"10k": 15.0, "40k": 24.0}
    assert latency_us_at(table, 1000) == 15.0                                  # below: latency-bound
    assert latency_us_at(table, 25 * 1024) == pytest.approx(19.5)             # between: linear
    assert latency_us_at(table, 80 * 1024) == pytest.approx(48.0)             # above, no bulk figure: in proportion
    assert latency_us_at(table, 40960 + 145e3, bulk_gbps=145) == pytest.approx(25.0)  # above: + bytes / bulk


def test_kv_share_under_tp2():
    assert kv_share_tp2(4) == 0.5 and kv_share_tp2(8) == 0.5
    assert kv_share_tp2(1) == 1.0  # one KV head cannot be split: replicated


@pytest.mark.parametrize("hardware", HARDWARE)
@pytest.mark.parametrize("model", MODELS)
def test_every_catalogue_pair_gets_an_answer(hardware, model):
    """fits with speeds and ceilings, or says why in numbers; a prediction never exceeds its ceiling."""
    m = model_from_doc(catalogue.get("model", model))
    family = tuple(model_from_doc(d) for d in catalogue.all_of("model") if d["family"] == m.family)
    hw = hardware_from_doc(catalogue.get("hardware", hardware), 2)
    p = plan(hw, m, plan_inputs.engine("ninfer-v100-tp"), Target(32 * K, 2), alternatives=family)
    assert len(p.strategies) == 4 and [s.name for s in p.strategies] == ["single", "replicas", "layer_split", "tp2"]
    for s in p.strategies:
        assert s.reason
        assert s.allreduce_path in ("nccl", "gloo", "host_mailbox", "device_mailbox", "none")
        if s.fits and s.decode_tok_s is not None:
            assert 0 < s.decode_tok_s <= s.decode_ceiling_tok_s
            assert s.aggregate_tok_s <= s.aggregate_ceiling_tok_s
            assert s.max_context >= 32 * K
        if not s.fits:
            assert s.decode_tok_s is None and s.prefill_s is None
            assert any(ch.isdigit() for ch in s.reason), s.reason
    if any(s.fits for s in p.strategies):
        assert p.recommended in {s.name for s in p.strategies if s.fits}
        assert p.launch["strategy"] == p.recommended
    else:
        assert p.recommended is None and p.launch is None
        # a nearest configuration is named, unless no format of the family fits the two cards' memory at all
        # (a 10 GB RTX 3080 pair and a 32B model: 2 x 9.3 GiB against 18 GB of 4-bit weights plus the runtime)
        smallest = min(x.weights_replicated_gb + x.weights_split_gb / 2 for x in family + (m,))   # a tp2 rank
        reserve = plan_inputs.engine("ninfer-v100-tp").runtime_reserve_gb.value
        assert p.nearest_fit is not None or smallest + reserve > 0.95 * hw.card.memory_gb, \
            "nothing fits and no nearest configuration named"


def test_fp16_32b_does_not_fit_two_v100s_and_says_why():
    p = plan_ids("v100-pg500-216", 2, "qwen2.5-32b-fp16", 32 * K)
    tp2 = p.strategy("tp2")
    assert not tp2.fits
    assert "32.0 GiB per GPU" in tp2.reason  # a "32 GB" V100, as nvidia-smi and the seller count it
    assert not any(s.fits for s in p.strategies)


def test_nearest_fit_named_when_nothing_fits():
    models = tuple(model_from_doc(d) for d in catalogue.all_of("model"))
    hw = hardware_from_doc(catalogue.get("hardware", "v100-pcie-16gb"), 1)
    m = model_from_doc(catalogue.get("model", "qwen3.8-27b-nvfp4"))
    e = plan_inputs.engine("ninfer-v100-tp")
    p = plan(hw, m, e, Target(200 * K, 1), alternatives=models)
    assert not any(s.fits for s in p.strategies)
    nf = p.nearest_fit
    assert nf is not None and nf["gpus"] == 2 and nf["strategy"] in ("tp2", "layer_split")
    again = plan(hardware_from_doc(catalogue.get("hardware", "v100-pcie-16gb"), 2), m, e, Target(200 * K, 2))
    assert any(s.fits for s in again.strategies)


def test_nearest_fit_falls_back_to_a_shorter_context():
    hw = hardware_from_doc(catalogue.get("hardware", "v100-pcie-16gb"), 2)
    m = model_from_doc(catalogue.get("model", "qwen3.8-27b-nvfp4"))
    e = plan_inputs.engine("ninfer-v100-tp")
    p = plan(hw, m, e, Target(256 * K, 2))
    assert not any(s.fits for s in p.strategies)
    nf = p.nearest_fit
    assert nf["context_tokens"] < 256 * K
    assert nf["change"] == f"a context of at most {nf['context_tokens']:,} tokens"
    assert plan(hw, m, e, Target(nf["context_tokens"], 2)).strategy(nf["strategy"]).fits


def test_max_context_is_where_memory_runs_out():
    p = plan_ids("v100-pcie-16gb", 2, "qwen3.8-27b-nvfp4", 8 * K)
    tp2 = p.strategy("tp2")
    assert 0 < tp2.max_context < 262144
    assert plan_ids("v100-pcie-16gb", 2, "qwen3.8-27b-nvfp4", tp2.max_context).strategy("tp2").fits
    assert not plan_ids("v100-pcie-16gb", 2, "qwen3.8-27b-nvfp4", tp2.max_context + 64).strategy("tp2").fits


def test_context_beyond_native_is_refused():
    s = plan_ids("h200", 2, "llama3.1-8b-fp16", 256 * K).strategy("single")
    assert not s.fits and "native" in s.reason


def test_one_gpu_rules_out_multi_gpu_strategies():
    p = plan_ids("h200", 1, "llama3.1-8b-fp16", 8 * K)
    assert p.strategy("single").fits
    for name in ("replicas", "layer_split", "tp2"):
        assert not p.strategy(name).fits and "needs 2 GPUs, 1 given" in p.strategy(name).reason


def test_objective_throughput_prefers_aggregate():
    lat = plan_ids("h200", 2, "llama3.1-8b-fp16", 8 * K)
    thr = plan_ids("h200", 2, "llama3.1-8b-fp16", 8 * K, objective="throughput")
    assert lat.recommended == "tp2"
    assert thr.recommended == "replicas"


def test_placeholder_engine_gives_fit_but_no_speeds():
    """An engine profile with no efficiencies and no stand-in engine (SGLang's profile without its 'stand_in_engine'):
    fit and the ceiling, no speeds, and the plan document says what is missing."""
    import copy

    doc = copy.deepcopy(catalogue.get("engine", "sglang"))
    del doc["stand_in_engine"]
    hw = hardware_from_doc(catalogue.get("hardware", "v100-pg500-216"), 2)
    p = plan(hw, model_from_doc(catalogue.get("model", "qwen3.8-27b-nvfp4")), engine_from_doc(doc),
             Target(context_tokens=32 * K, gpus=2))
    assert p.recommended is None and all(s.decode_tok_s is None for s in p.strategies)
    assert p.speeds["calibrated"] is False and p.speeds["stand_in"] is None
    assert p.speeds["missing"] == ["weight_bw_fraction", "kv_bw_fraction", "round_overhead_ms"]
    assert all("v100plan bench engine" in s.reason for s in p.strategies if s.fits)
    # bytes and bandwidth are known, so the ceiling is shown even without speeds
    assert all(s.decode_ceiling_tok_s for s in p.strategies if s.fits)


def test_dense_models_do_not_speculate_and_use_fp16_on_volta():
    p = plan_ids("v100-pg500-216", 2, "qwen2.5-32b-int4-gptq", 32 * K)
    assert p.inputs["draft_tokens"] == 0 and p.launch["dtype"] == "float16"
    # an fp16 file is served in fp16 on a card with bf16 too (a bf16 launch would convert it)
    assert plan_ids("h200", 1, "llama3.1-8b-fp16", 8 * K).launch["dtype"] == "float16"


def test_allreduce_path_from_the_box():
    assert plan_ids("v100-pg500-216", 2, "qwen3.8-27b-nvfp4", 8 * K).strategy("tp2").allreduce_path == "host_mailbox"
    assert plan_ids("v100-sxm2-32gb", 2, "qwen3.8-27b-nvfp4", 8 * K).strategy("tp2").allreduce_path == "device_mailbox"
    # P2P unknown (stock PCIe V100): no device mailbox until a probe says P2P works.
    assert plan_ids("v100-pcie-32gb", 2, "qwen3.8-27b-nvfp4", 8 * K).strategy("tp2").allreduce_path == "host_mailbox"


def _probe(name):
    from v100plan import documents

    return documents.load(f"{FIXTURES}/{name}", "probe_report")


def test_probe_report_broken_p2p_means_host_mailbox():
    hw = hardware_from_probe(_probe("facts-pg500-216-pair-broken-p2p.json"), catalogue.all_of("hardware"), "probe.json")
    assert hw.card.id == "v100-pg500-216" and hw.gpus == 2 and hw.pair.p2p == "broken"
    assert hw.card.read_bw.source.startswith("measured: probe report")


def test_probe_report_hot_card_slows_the_pair():
    hw = hardware_from_probe(_probe("facts-sxm2-pair-nvlink-hot-card1.json"), catalogue.all_of("hardware"), "probe.json")
    assert hw.pair.p2p == "working" and hw.pair.sm_clock_ratio.value == pytest.approx(0.742, abs=0.01)


def test_probe_report_nccl_without_the_arch_is_never_chosen():
    report = _probe("facts-pg500-216-pair-broken-p2p.json")
    report = {**report, "cards": [{**c, "nccl_supported": False} for c in report["cards"]],
              "host": {**report["host"], "nccl_version": "2.31", "nccl_archs": ["sm_80", "sm_90"]}}
    hw = hardware_from_probe(report, catalogue.all_of("hardware"), "probe.json")
    m = model_from_doc(catalogue.get("model", "qwen3.8-27b-nvfp4"))
    e = plan_inputs.engine("ninfer-v100-tp")
    p = plan(hw, m, e, Target(8 * K, 2))
    assert p.strategy("tp2").allreduce_path == "host_mailbox"
    assert any("nccl" in n and "sm_80" in n for n in p.notes)


def test_planning_is_fast_and_pure():
    start = time.perf_counter()
    first = [plan_ids(h, 2, m, 128 * K) for h in HARDWARE for m in MODELS]
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"{len(first)} plans took {elapsed:.2f} s"
    assert [plan_ids(h, 2, m, 128 * K) for h in HARDWARE for m in MODELS] == first


def test_engine_allreduce_figures_may_mark_a_path_unavailable():
    doc = dict(catalogue.get("engine", "ninfer-v100-tp"))
    doc["allreduce_us"] = {"nccl": {"unavailable": "no sm_70 kernels"}, "host_mailbox": {"8k": 11.0, "40k": 15.0}}
    from v100plan import documents

    documents.validate(doc, "engine_profile")
    e = engine_from_doc(doc)
    assert e.allreduce_us == {"host_mailbox": {"8k": 11.0, "40k": 15.0}}
    hw = hardware_from_doc(catalogue.get("hardware", "v100-pcie-32gb"), 2)
    p = plan(hw, model_from_doc(catalogue.get("model", "qwen3.8-27b-nvfp4")), e, Target(8 * K, 2))
    assert p.strategy("tp2").allreduce_path == "host_mailbox"
    assert any("nccl: no latency figure" in n for n in p.notes)


def test_probe_report_with_mixed_cards_says_so():
    report = _probe("facts-pg500-216-pair-broken-p2p.json")
    cards = [dict(c) for c in report["cards"]]
    cards[1].update(pci_device_id="10de:1db5", read_bw_gbps=878.0, memory_total_gib=16.0)
    hw = hardware_from_probe({**report, "cards": cards}, catalogue.all_of("hardware"), "probe.json")
    assert hw.card.read_bw.value == 878.0 and hw.card.memory_gib == 16.0
    assert any("the cards differ" in n for n in hw.notes)


MOE = "qwen3-30b-a3b-int4-gptq"


def test_moe_one_token_reads_only_its_experts():
    m = model_from_doc(catalogue.get("model", MOE))
    s = plan_ids("v100-pg500-216", 1, MOE, 8 * K).strategy("single")
    expected = m.decode_read_gb + m.moe_expert_gb * 8 / 128
    assert s.breakdown["decode"]["weights_read_gb"] == pytest.approx(expected, abs=0.01)
    assert s.breakdown["decode"]["weights_read_gb"] < 0.2 * m.weights_total_gb


def test_moe_batches_touch_more_experts():
    m = model_from_doc(catalogue.get("model", MOE))
    one = plan_ids("v100-pg500-216", 1, MOE, 1 * K).strategy("single")
    many = plan_ids("v100-pg500-216", 1, MOE, 1 * K, concurrency=32)
    s = many.strategy("single")
    touched = 1 - (1 - 8 / 128) ** 32
    assert s.breakdown["decode"]["weights_read_gb"] == pytest.approx(m.decode_read_gb + m.moe_expert_gb * touched, abs=0.01)
    assert one.aggregate_tok_s < s.aggregate_tok_s < 32 * one.aggregate_tok_s
    assert any("MoE" in n for n in many.notes)


def test_moe_tp2_splits_the_expert_reads():
    p = plan_ids("v100-pg500-216", 2, MOE, 8 * K)
    single, tp2 = p.strategy("single").breakdown["decode"], p.strategy("tp2").breakdown["decode"]
    assert tp2["weights_read_gb"] < single["weights_read_gb"]


def test_tp2_fractions_apply_to_tp2_only_and_fall_back_per_field():
    """tp2_weight_bw_fraction / tp2_kv_bw_fraction divide only the tp2 round; each absent one falls back to
    the one-card figure on its own, and the plan notes the fallback."""
    import copy

    doc = copy.deepcopy(catalogue.get("engine", "ninfer-v100-tp"))
    hw = hardware_from_doc(catalogue.get("hardware", "v100-pg500-216"), 2)
    m = model_from_doc(catalogue.get("model", "qwen3.8-27b-groupwise-int"))
    t = Target(64 * K, 2)
    base = plan(hw, m, engine_from_doc(doc), t)
    doc["efficiency"]["tp2_kv_bw_fraction"] = {"value": 0.3, "source": "test"}
    half = plan(hw, m, engine_from_doc(doc), t)
    doc["efficiency"]["tp2_weight_bw_fraction"] = {"value": 0.2, "source": "test"}
    both = plan(hw, m, engine_from_doc(doc), t)
    b, h, w = (p.strategy("tp2").breakdown["decode"] for p in (base, half, both))
    assert (b["weight_bw_fraction"], b["kv_bw_fraction"]) == (0.33, 0.403)  # groupwise-int's by-format figure
    assert (h["weight_bw_fraction"], h["kv_bw_fraction"]) == (0.33, 0.3)
    assert (w["weight_bw_fraction"], w["kv_bw_fraction"]) == (0.2, 0.3) and w["fractions_source"]["weight"] == "test"
    assert h["kv_ms"] == pytest.approx(b["kv_ms"] * 0.403 / 0.3, rel=1e-3)
    assert w["weights_ms"] == pytest.approx(b["weights_ms"] * 0.33 / 0.2, rel=1e-3)
    assert both.strategy("single").breakdown["decode"] == base.strategy("single").breakdown["decode"]
    assert any("no tp2_weight_bw_fraction" in n for n in half.notes)
    assert not any("one-card fractions" in n for n in both.notes)
