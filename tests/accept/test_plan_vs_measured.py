"""The report holds the plan against the measurement (v100plan/accept/plan_vs_measured.py): a real
`python -m engine serve` of the demo model, a real plan document, the timed long-prompt request over HTTP; the
section in report.json (validated against its schema) and in the HTML; and `accept --plan` writing it."""

from __future__ import annotations

import json

import pytest

from tests.paths import REPO
from tests.test_service_support import demo_model, service_fixture
from v100plan import documents
from v100plan.accept import plan_vs_measured as pvm
from v100plan.accept.context import AcceptOptions, Context, Target
from v100plan.planning import plan_document
from v100plan.report.html import render_html

KEY = "pvm-key-3c1"
svc = service_fixture(api_key=KEY)  # no --max-context: the demo's native 4096


def test_figure_error_and_interval():
    f = pvm.figure("decode_tok_s", "tok/s", 50.0, [40.0, 60.0], 55.0, None)
    assert f["error"] == 0.1 and f["inside_interval"] is True and f["why"] is None
    f = pvm.figure("decode_tok_s", "tok/s", 50.0, [40.0, 60.0], 30.0, None)
    assert f["error"] == -0.4 and f["inside_interval"] is False
    f = pvm.figure("memory_per_gpu_gb", "GB", 17.3, None, None, "the ranks report no card memory")
    assert f["error"] is None and f["inside_interval"] is None and f["why"] == "the ranks report no card memory"
    f = pvm.figure("max_context", "tokens", 4096, None, 4096, None)
    assert f["error"] == 0.0 and f["inside_interval"] is None and "no interval" in f["why"]


@pytest.fixture(scope="module")
def plan():
    return plan_document("h200", 2, str(demo_model()), "v100plan", "2K", None, 1, "latency")


@pytest.fixture(scope="module")
def ctx(svc):
    c = Context(Target(endpoint=svc.url, api_key=KEY), AcceptOptions())
    c.discover()
    yield c
    c.close()


@pytest.mark.slow
def test_a_cpu_engine_is_not_held_against_a_gpu_plan(ctx, plan):
    assert ctx.is_engine and ctx.max_context == 4096
    sec = pvm.section(ctx, plan, gpu=None)  # the engine's /health says its ranks run on CPU
    assert sec["figures"] == [] and "runs on CPU" in sec["why"]
    sec = pvm.section(ctx, None, gpu=False)
    assert sec["figures"] == [] and "no GPU" in sec["why"] and "planner does not model" in sec["why"]
    assert "no GPU" in pvm.section(ctx, None, gpu=None)["why"]  # found from /health, as above
    assert pvm.section(ctx, None, gpu=True)["why"].startswith("no plan given")


@pytest.mark.slow
def test_measured_over_http_against_the_plans_tp2_row(ctx, plan, tmp_path):
    """The comparison forced on the CPU service (gpu=True): every figure measured by the real request where the
    service reports it, the error and interval judged from those numbers."""
    (tp2,) = [s for s in plan["strategies"] if s["name"] == "tp2"]
    sec = pvm.section(ctx, plan, gpu=True)
    assert sec["strategy"] == "tp2" and sec["context_tokens"] == 2048 and sec["why"] is None
    assert sec["measured_context_tokens"] == 2048 - 1  # prompt + 64 generated, one position short of the context
    by = {f["figure"]: f for f in sec["figures"]}
    assert list(by) == ["decode_tok_s", "ttft_s", "memory_per_gpu_gb", "max_context"]
    dec = by["decode_tok_s"]
    assert dec["predicted"] == tp2["decode_tok_s"] and dec["interval"] == tp2["decode_tok_s_interval"]
    assert dec["measured"] > 0 and dec["error"] == round((dec["measured"] - dec["predicted"]) / dec["predicted"], 4)
    assert dec["inside_interval"] == (dec["interval"][0] <= dec["measured"] <= dec["interval"][1])
    ttft = by["ttft_s"]
    assert ttft["predicted"] == tp2["ttft_s"] and 0 < ttft["measured"] < 120
    mem = by["memory_per_gpu_gb"]
    assert mem["predicted"] == tp2["memory_per_gpu_gb"] and mem["measured"] is None and "CPU" in mem["why"]
    mc = by["max_context"]
    assert mc["measured"] == 4096 and mc["predicted"] == tp2["max_context"]
    assert any("1983 prompt tokens, 64 generated" in n for n in sec["notes"])
    calibrate = [n for n in sec["notes"] if "v100plan calibrate --endpoint" in n]  # the way to a profile that fits
    assert len(calibrate) == (0 if dec["inside_interval"] else 1)
    assert all(f"--endpoint {ctx.target.endpoint} " in n for n in calibrate)

    # into a report: valid against the schema, drawn in the HTML
    report = json.loads((REPO / "tests/fixtures/acceptance/sample-report.json").read_text())
    report["plan_vs_measured"] = sec
    documents.validate(report, "acceptance_report")
    html = render_html(report)
    assert "Plan against measurement" in html and "decode at the served context" in html
    assert f"{dec['error'] * 100:+.1f} %" in html and "not measured" in html
    report["plan_vs_measured"] = pvm.empty("no GPU: the service runs on CPU")
    documents.validate(report, "acceptance_report")
    assert "No figures: no GPU: the service runs on CPU" in render_html(report)
