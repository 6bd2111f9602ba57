"""Structured output and tool calls, as coding agents use them: scenarios that run against the bundled engine
and against any OpenAI-compatible endpoint (vLLM, SGLang, llama.cpp's server). Both ask for answers a
constrained decoder must produce whatever the weights are, so they hold on a random-weight demo too."""

from __future__ import annotations

import json

import jsonschema

from v100plan.accept.cases import Outcome, case
from v100plan.accept.context import Context

F = "functional"

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "outdoor": {"type": "boolean"}},
          "required": ["city", "days", "outdoor"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"enum": ["Paris", "Rome", "Oslo"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                             "required": ["city", "days"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Plan a trip: which city, how many days, outdoors or not? Answer in JSON."}]


def _valid(o: Outcome, what: str, text: str | None, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text or ""), schema)
    except (ValueError, jsonschema.ValidationError) as exc:
        return o.check(False, f"{what}: not JSON valid against the schema ({str(exc).splitlines()[0][:160]}): "
                              f"{(text or '')[:120]!r}")
    return True


@case("structured_output", "response_format json_schema (strict): the answer is JSON valid against the schema, "
      "streamed and not", group=F, timeout_s=240)
def structured_output(ctx: Context) -> Outcome:
    o = Outcome()
    body = {"model": ctx.model, "messages": MESSAGES, "max_tokens": 96, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA,
                                                                      "strict": True}}}
    a = ctx.client.post("/v1/chat/completions", body)
    o.note("http", f"POST /v1/chat/completions (json_schema) -> {a.status}", a.status, a.elapsed_s)
    if not o.check(a.ok, f"answered {a.status}: {a.error_message()}"):
        return o
    _valid(o, "the answer", a.text(), SCHEMA)
    s = ctx.client.stream("/v1/chat/completions", body)
    o.note("http", f"the same, streamed -> {s.status}", s.status)
    if o.check(s.status == 200 and s.done, f"the stream answered {s.status} (done: {s.done})"):
        _valid(o, "the streamed answer", s.text(), SCHEMA)
    return o


@case("tool_call", "a named tool_choice returns a tool call whose arguments are valid against the function's "
      "parameters; the tool's answer (role tool, tool_call_id) is taken back", group=F, timeout_s=240)
def tool_call(ctx: Context) -> Outcome:
    o = Outcome()
    body = {"model": ctx.model, "messages": MESSAGES, "max_tokens": 64, "temperature": 0, "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    a = ctx.client.post("/v1/chat/completions", body)
    o.note("http", f"POST /v1/chat/completions (named tool_choice) -> {a.status}", a.status, a.elapsed_s)
    if not o.check(a.ok, f"answered {a.status}: {a.error_message()}"):
        return o
    message = ((a.body.get("choices") or [{}])[0]).get("message") or {}
    calls = message.get("tool_calls") or []
    if not o.check(len(calls) >= 1, f"no tool_calls in the answer: {json.dumps(message)[:200]}"):
        return o
    fn = calls[0].get("function") or {}
    o.check(fn.get("name") == "get_weather", f"the call names {fn.get('name')!r}, expected 'get_weather'")
    if not _valid(o, "the call's arguments", fn.get("arguments"), TOOL["function"]["parameters"]):
        return o
    back = {"model": ctx.model, "max_tokens": 8, "temperature": 0, "tools": [TOOL],
            "messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [calls[0]]},
                         {"role": "tool", "tool_call_id": calls[0].get("id"), "content": "sunny, 21 C"}]}
    b = ctx.client.post("/v1/chat/completions", back)
    o.note("http", f"the tool's answer back (role tool) -> {b.status}", b.status, b.elapsed_s)
    o.check(b.ok, f"a role tool message was answered {b.status}: {b.error_message()}")
    return o
