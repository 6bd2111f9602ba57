"""`deploy` without --plan plans the probed host itself (v100plan/remote/own_plan.py): the bundled engine runs the
plan's tp2 settings (dtype, K/V, MTP and draft tokens, allreduce), with the context left to the engine's own
memory-bounded default; the probe's settings stand, saying why, where no plan can run. Judged on recorded probes
of real hosts (the field's two V100-SXM2 and the lent H200s) and the 27B GPTQ config in the multimodal layout."""

from __future__ import annotations

import json

from tests.paths import REPO
from tests.remote_support import v100_pair_with_h200_torch
from v100plan.planning import plan_document
from v100plan.remote.own_plan import settings_for_host

CONFIG_27B = REPO / "tests/fixtures/planner/qwen3.5-27b-gptq-multimodal.config.json"
H200X2 = json.loads((REPO / "tests/fixtures/probes/h200x2-probe-quick.json").read_text())


def test_two_v100s_run_the_plans_tp2_settings_and_the_engines_context():
    v100, _ = v100_pair_with_h200_torch()
    s, why, origin = settings_for_host(v100, CONFIG_27B, "box", 8000, False, None)
    plan = plan_document(v100, None, str(CONFIG_27B), "v100plan", "4096", None, 1, "latency")
    tp2 = next(r for r in plan["strategies"] if r["name"] == "tp2")
    assert s.device == "cuda" and s.dtype == plan["launch"]["dtype"] == "float16"
    assert s.draft_tokens == plan["launch"]["draft_tokens"] == 3  # the config's MTP layer
    assert s.allreduce == tp2["allreduce_path"]
    assert s.max_context is None and "the engine's default (native, bounded by memory)" in why
    assert s.max_concurrency == 1 and "1 request at a time (the plan's concurrency)" in why  # as the plan priced
    assert why.startswith("settings from deploy's own plan for box") and "MTP speculation with 3 draft tokens" in why
    assert origin["plan"] == "deploy's own plan for box" and origin["decode_tok_s"] == tp2["decode_tok_s"]
    assert len(origin["plan_sha256"]) == 64


def test_a_given_context_is_kept_and_another_host_gets_its_own_plan():
    s, why, origin = settings_for_host(H200X2, CONFIG_27B, "h200", 8000, True, 65536)
    assert s.max_context == 65536 and "context limit 65536" in why and s.fault_injection
    v100_origin = settings_for_host(v100_pair_with_h200_torch()[0], CONFIG_27B, "box", 8000, True, None)[2]
    assert s.device == "cuda" and origin["gpus"] == v100_origin["gpus"] == 2
    assert origin["decode_tok_s"] > 2 * v100_origin["decode_tok_s"]  # the H200s' own plan, not a shared one


def test_one_card_serves_on_cpu_and_an_unplannable_model_keeps_the_probes_settings(tmp_path):
    _, h200 = v100_pair_with_h200_torch()  # one card
    s, why, origin = settings_for_host(h200, CONFIG_27B, "one", 8000, False, None)
    assert s.device == "cpu" and origin is None and "run on CPU" in why
    v100, _ = v100_pair_with_h200_torch()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mystery"}))
    s, why, origin = settings_for_host(v100, tmp_path, "box", 8000, False, None)
    assert s.device == "cuda" and s.allreduce == "auto" and origin is None
    assert "(not planned: " in why and s.chosen_by == "probe of box"
