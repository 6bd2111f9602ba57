"""Clients nobody here wrote, run against a served random-weight demo (TP2 on CPU, API key on), each as its own
process over real HTTP:

- guidellm, the serving benchmark: a bounded streamed run (6 chat requests, 2 at a time, 16-token prompts,
  8 output tokens, a time cap), with the demo's own tokenizer; judged from guidellm's own JSON report against
  what the service's /metrics counted.
- the OpenAI Agents SDK (openai-agents): an agent with one function tool and a model_settings tool_choice naming
  it (constrained decoding makes even random weights call it with valid arguments); the SDK must invoke the
  Python function itself, with arguments that validate against the schema it sent, and the run must end.

Both live in a folder of their own (tests/service/third_party_clients.requirements.txt says how .ci/run
installs it). Missing, these tests fail and say how to install; V100PLAN_REQUIRE_CLIENTS=0 skips them instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import distributions
from pathlib import Path

import jsonschema
import pytest

from tests.test_service_support import MODEL_ID, REPO, demo_model, service_fixture, short_dir

pytestmark = pytest.mark.slow

KEY = "sk-clients-" + os.urandom(6).hex()
REQUIREMENTS = "tests/service/third_party_clients.requirements.txt"
CLIENTS = {"guidellm": "guidellm", "openai-agents": "agents"}  # distribution -> the package it installs

svc = service_fixture(model=demo_model, api_key=KEY, stall_timeout_s=60, allreduce_timeout_s=30)


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / REQUIREMENTS).read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, ver = line.partition("==")
            pins[name.lower()] = ver
    return pins


@pytest.fixture(scope="module")
def clients_dir() -> str:
    """The folder the clients were installed into (V100PLAN_CLIENTS_DIR, else .venv/clients), with the pinned
    versions of both; a clear failure (or, with V100PLAN_REQUIRE_CLIENTS=0, a skip) when it is not there."""
    where = os.environ.get("V100PLAN_CLIENTS_DIR") or str(REPO / ".venv" / "clients")
    found = {d.metadata["Name"].lower(): d.version for d in distributions(path=[where])}
    pins = _pins()
    wrong = [f"{name}=={pins[name]} (found {found.get(name, 'none')})" for name in CLIENTS
             if found.get(name) != pins[name]]
    if wrong:
        message = (f"third-party clients missing from {where}: {', '.join(wrong)}. Install them as .ci/run does: "
                   f"pip install --no-deps --target {where} -r {REQUIREMENTS} (V100PLAN_CLIENTS_DIR names another "
                   f"folder; V100PLAN_REQUIRE_CLIENTS=0 skips these tests instead)")
        if os.environ.get("V100PLAN_REQUIRE_CLIENTS") == "0":
            pytest.skip(message)
        pytest.fail(message)
    return where


def _env(clients: str) -> dict:
    # offline: nothing may reach a hub; the clients' folder first (it shadows nothing of the test's own process)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([clients, str(REPO)]), "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OPENAI_AGENTS_DISABLE_TRACING": "1",
            "PYTHONUNBUFFERED": "1"}


def _counters(svc) -> dict[str, float]:
    return {"completion": svc.metric("v100plan_completion_tokens_total"),
            "prompt": svc.metric("v100plan_prompt_tokens_total"),
            "chat_ok": svc.metric("v100plan_requests_total", '{endpoint="/v1/chat/completions",status="200"}'),
            "chat_all": sum(float(line.split()[-1]) for line in svc.client.get("/metrics").text.splitlines()
                            if line.startswith('v100plan_requests_total{endpoint="/v1/chat/completions"'))}


def _run(cmd: list[str], clients: str, timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=short_dir("client"), env=_env(clients), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd[2:4]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_guidellm_benchmark_completes_without_errors_and_counts_what_the_service_served(svc, clients_dir):
    requests, output_tokens = 6, 8
    out = os.path.join(short_dir("guidellm"), "report.json")
    before = _counters(svc)
    _run([sys.executable, "-m", "guidellm", "run",
          "--backend", f"kind=openai_http,target={svc.url},model={MODEL_ID},api_key={KEY},timeout=120",
          "--profile", "kind=concurrent,streams=2",
          "--constraint", f"kind=max_requests,count={requests}",
          "--constraint", "kind=max_duration,seconds=180",
          "--tokenizer", f"kind=huggingface_auto,model={demo_model()}",
          "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={output_tokens}",
          "--seed", "kind=static,value=7",
          "--output", f"kind=json,path={out}", "--disable-console"], clients_dir, timeout=400)
    after = _counters(svc)
    report = json.loads(Path(out).read_text())
    (bench,) = report["benchmarks"]
    errors = [r["info"].get("error") for r in bench["requests"]["errored"]]
    totals = bench["metrics"]["request_totals"]
    assert totals == {"successful": requests, "errored": 0, "incomplete": 0, "total": requests}, (totals, errors)
    done = bench["requests"]["successful"]
    assert len(done) == requests
    for r in done:
        body = json.loads(r["request_args"])["body"]
        assert body["stream"] is True and body["max_completion_tokens"] == output_tokens  # what guidellm sends
        assert r["output_metrics"]["text_tokens"] == output_tokens  # ignore_eos honoured: exactly as asked
    m = bench["metrics"]
    # guidellm's own token counts equal what the service says it generated and prefilled for these requests
    assert m["output_token_count"]["successful"]["total_sum"] == after["completion"] - before["completion"] \
        == requests * output_tokens
    assert m["prompt_token_count"]["successful"]["total_sum"] == after["prompt"] - before["prompt"] > 0
    assert after["chat_ok"] - before["chat_ok"] == after["chat_all"] - before["chat_all"] == requests
    # it measured a stream: a first token and inter-token gaps for every request
    assert m["time_to_first_token_ms"]["successful"]["count"] == requests
    assert m["inter_token_latency_ms"]["successful"]["count"] == requests * (output_tokens - 1)


def test_openai_agents_sdk_calls_the_named_tool_with_valid_arguments(svc, clients_dir):
    out = os.path.join(short_dir("agent"), "agent.json")
    before = len([e for e in svc.events("request") if e.get("outcome") == "tool_calls"])
    _run([sys.executable, str(REPO / "tests" / "service" / "third_party_agent.py"), f"{svc.url}/v1", MODEL_ID, KEY,
          out], clients_dir, timeout=300)
    got = json.loads(Path(out).read_text())
    assert got["version"] == _pins()["openai-agents"]
    # the SDK sent a strict schema built from the function's signature, and called the function exactly once
    schema = got["schema"]
    assert got["strict"] and schema["properties"]["city"]["enum"] == ["Paris", "Rome"]
    assert (schema["properties"]["days"]["minimum"], schema["properties"]["days"]["maximum"]) == (1, 7)
    (call,) = got["calls"]
    jsonschema.validate(call, schema)
    # stop_on_first_tool: the tool's own return value ends the run, after one model response
    assert got["final_output"] == f"{call['city']}: sunny for {call['days']} days"
    assert got["model_responses"] == 1
    calls = [e for e in svc.events("request") if e.get("outcome") == "tool_calls"]
    assert len(calls) == before + 1 and calls[-1]["kind"] == "chat"


def test_continuous_usage_stats_counts_every_chunk(svc):
    """vLLM's stream_options.continuous_usage_stats, which guidellm sends on every streamed request."""
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "count with me"}], "max_tokens": 5,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = []
    with svc.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert all("usage" in c for c in chunks) and done == sorted(done) and done[0] == 0 and done[-1] == 5
    prompt = {c["usage"]["prompt_tokens"] for c in chunks}
    assert len(prompt) == 1 and all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] +
                                    c["usage"]["completion_tokens"] for c in chunks)
    body["stream_options"] = {"continuous_usage_stats": True}  # without include_usage: no usage mid-stream
    with svc.client.stream("POST", "/v1/chat/completions", json=body) as r:
        mid = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")][:-1]
    assert mid and not any("usage" in c for c in mid)
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": "yes"}
    bad = svc.client.post("/v1/chat/completions", json=body)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_options.continuous_usage_stats"
