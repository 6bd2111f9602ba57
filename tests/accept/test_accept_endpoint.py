"""`v100plan accept --endpoint` against a server of another make (transformers serve on the demo
model, tests/independent_server.py): the functional and load scenarios pass, the fault scenarios
are waived with the reason, and what this make lacks shows up as the report says it does."""

from __future__ import annotations

import pytest

from tests.accept_support import report, run_cli, scenario
from tests.independent_server import independent_server  # noqa: F401 - the session fixture

pytestmark = pytest.mark.slow


def test_accept_passes_an_independent_server_with_faults_waived(independent_server, tmp_path):  # noqa: F811
    srv = independent_server
    out = tmp_path / "report"
    # Two scenarios this make fails, found by this suite and shown in the test below: it keeps the matched
    # stop string in the text (LACKS["stop_excluded"]) and answers some wrong types with a 500 or a reset
    # connection; it enforces no structured output or named tool choice. They are left out here on purpose;
    # everything else must pass.
    r = run_cli("accept", "--endpoint", srv.url, "--model", srv.model, "--requests", "16", "--clients", "4",
                "--skip", "stop_sequence,bad_input,structured_output,tool_call", "--out", out, env={"OMP_NUM_THREADS": "1"})
    doc = report(out)
    # transformers 5.25's server joins the texts waiting in a stream's queue into one event when its writer falls
    # behind (serving/utils.py read_queue_outputs: "a stream that fell behind sends them as one event"): on a busy
    # host the stream scenario then sees fewer events than tokens and fails, as it should. That failure, and only
    # that one, is this make's; with an idle host the run passes whole.
    bad = [s for s in doc["scenarios"] if s["status"] in ("failed", "error")]
    if bad:
        (st,) = bad
        assert st["key"] == "stream" and "not sent token by token" in st["reason"], bad
        assert 0 < st["metrics"]["token_events"] < 0.9 * st["metrics"]["tokens"] and r.returncode != 0
    else:
        assert r.returncode == 0 and doc["verdict"] == "passed", r.stderr[-3000:]
    assert doc["target"]["mode"] == "endpoint"
    assert doc["target"]["server"] != "v100plan engine" and doc["target"]["fault_control"] is False
    faults = [s for s in doc["scenarios"] if s["group"] == "fault"]
    assert len(faults) == 8 and all(s["status"] == "waived" and "bundled engine" in s["reason"] for s in faults)
    for key in ("completion", "chat", "seeded_sample", "max_tokens", "openai_client", "load"):
        assert scenario(doc, key)["status"] in ("passed", "warned"), scenario(doc, key)
    for key in ("stream_cancel", "gone_in_prefill", "tp2_equals_tp1", "rank_logs_agree", "prefix_reuse",
                "spec_equals_plain"):
        assert scenario(doc, key)["status"] == "waived"
    assert scenario(doc, "auth")["status"] == "waived"  # this make has no API key option
    assert any("ignore_eos" in n for n in doc["target"]["notes"])
    assert doc["load"]["outcomes"].get("wrong", 0) == 0 and doc["load"]["outcomes"].get("lost", 0) == 0


def test_the_suite_finds_what_this_make_gets_wrong(independent_server, tmp_path):  # noqa: F811
    srv = independent_server
    out = tmp_path / "report"
    r = run_cli("accept", "--endpoint", srv.url, "--model", srv.model, "--only", "stop_sequence,bad_input,structured_output,tool_call",
                "--out", out, env={"OMP_NUM_THREADS": "1"})
    doc = report(out)
    assert r.returncode == 1 and doc["verdict"] == "failed"
    stop = scenario(doc, "stop_sequence")
    assert stop["status"] == "failed" and "stop" in stop["reason"]
    bad = scenario(doc, "bad_input")
    assert bad["status"] == "failed" and "expected 4xx" in bad["reason"]
    # transformers 5.25's server enforces no response_format (a json_schema request reset the connection) and
    # answers a named tool_choice with plain text: the structured scenarios say so.
    assert scenario(doc, "structured_output")["status"] == "failed"
    tool = scenario(doc, "tool_call")
    assert tool["status"] == "failed" and "no tool_calls" in tool["reason"]
