"""The serving-feature scenarios' decisions that need no service: how the suite reads whether the
service speculates (/health's block, /metrics' counters, the launch settings) and the waivers that
name the flag to change. The scenarios themselves run against real services in test_qualify.py
(speculation on, prefix reuse on, a hybrid model with an MTP layer) and test_accept_engine.py (a
dense model, no MTP layer)."""

from __future__ import annotations

import json

from v100plan.accept import features, serving
from v100plan.accept.context import AcceptOptions, Context, Target

METRICS = """# HELP v100plan_spec_draft_tokens_total MTP draft tokens proposed
# TYPE v100plan_spec_draft_tokens_total counter
v100plan_spec_draft_tokens_total 240.0
v100plan_spec_draft_tokens_created 1.7e9
v100plan_spec_accepted_tokens_total 7.0
"""


def _ctx(tmp_path, *, mtp: bool = False, engine: dict | None = None) -> Context:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_5", **({"mtp_num_hidden_layers": 1}
                                                                                if mtp else {})}))
    ctx = Context(Target(endpoint="http://127.0.0.1:9", model_dir=str(model), engine=engine), AcceptOptions())
    ctx.is_engine = True
    return ctx


def test_the_counters_are_read_from_prometheus_text():
    assert serving._counter(METRICS, serving.SPEC_DRAFTS) == 240.0
    assert serving._counter(METRICS, serving.SPEC_ACCEPTED) == 7.0
    assert serving._counter(METRICS, "v100plan_nothing_total") is None


def test_a_health_block_says_on_or_off_whichever_way_it_names_it():
    assert serving._block_says({"enabled": False, "draft_tokens": 3}) is False
    assert serving._block_says({"method": "mtp", "draft_tokens": 3, "acceptance_rate": 0.7}) is True
    assert serving._block_says({"mode": "off"}) is False
    assert serving._block_says({"draft_tokens": 0}) is False
    assert serving._block_says({"acceptance_rate": None}) is None


def test_prefix_reuse_is_waived_naming_the_flag_when_a_rank_says_it_is_off(tmp_path):
    ctx = _ctx(tmp_path)
    ctx.decode = {"0": {"mode": "eager", "prefix_cache": "off"}, "1": {"mode": "eager", "prefix_cache": "off"}}
    assert "--no-prefix-cache" in features._prefix_applicable(ctx)
    # off because the ranks hold several sequence slots (--max-concurrency N > 1): that is the reason given
    ctx.shared["concurrency"] = {"max_concurrency": 4, "bound": "memory", "why": "4 at once"}
    why = features._prefix_applicable(ctx)
    assert "up to 4 requests at once" in why and "--no-prefix-cache" not in why
    ctx.decode = {"0": {"prefix_cache": "on"}, "1": {"prefix_cache": "on"}}
    assert features._prefix_applicable(ctx) is None
    ctx.is_engine = False
    assert "bundled engine" in features._prefix_applicable(ctx)


def test_speculation_off_is_waived_naming_the_flag_and_the_missing_mtp_layer(tmp_path):
    ctx = _ctx(tmp_path)
    ctx.shared["speculation"] = {"on": False, "source": "/metrics", "draft_tokens": None}
    why = features._spec_applicable(ctx)
    assert "--speculative mtp" in why and "no MTP layer" in why
    ctx = _ctx(tmp_path, mtp=True)
    ctx.shared["speculation"] = {"on": False, "source": "/metrics", "draft_tokens": None}
    why = features._spec_applicable(ctx)
    assert "--speculative mtp" in why and "no MTP layer" not in why
    assert serving.served_draft_tokens(ctx) == 0


def test_speculation_on_needs_a_plain_reference_to_compare_with(tmp_path):
    ctx = _ctx(tmp_path, mtp=True, engine={"tp": 2, "dtype": "bfloat16"})
    ctx.shared["speculation"] = {"on": True, "source": "/metrics", "draft_tokens": None}
    assert features._spec_applicable(ctx) is None
    assert "bfloat16" in features._needs_plain_reference(ctx)
    assert serving.served_draft_tokens(ctx) is None  # on, with a count nobody said: no TP1 run draws alike
    ctx.target.model_dir = None
    ctx.target.engine = None
    assert "--model-dir" in features._needs_plain_reference(ctx)


def test_the_launch_settings_give_the_draft_count_when_the_service_does_not(tmp_path):
    # an unreachable endpoint: neither /health nor /metrics answers, the launch settings remain
    ctx = _ctx(tmp_path, mtp=True, engine={"speculative": {"method": "mtp", "draft_tokens": 2}})
    found = serving.speculation(ctx)
    assert found["on"] is True and found["draft_tokens"] == 2 and found["source"] == "the launch settings"
    assert serving.served_draft_tokens(ctx) == 2
    ctx.close()
