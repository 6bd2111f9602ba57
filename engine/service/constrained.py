"""What a chat request's tools and response_format ask of the answer: the tools the template shows, whether the
model's own tool-call text is parsed, and the grammar (engine.core.grammar) that constrains the answer.

- tool_choice none: the template is rendered without tools; nothing is parsed.
- auto (or left out with tools): the template shows the tools; the model's own ``<tool_call>`` text is
  parsed into tool_calls (engine.service.chat_output); nothing is constrained.
- a named function: the answer is constrained to that function's parameters (a JSON object valid
  against its schema), as vLLM does; it comes back as one tool call.
- required: the answer is constrained to ``[{"name": <a tool>, "parameters": {...}}, ...]`` (at least one;
  exactly one when parallel_tool_calls is false), as vLLM does.
- response_format json_object / json_schema: the answer is constrained to JSON (valid against the schema).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.service.app_http import ApiError
from engine.service.app_schemas import ChatRequest, NamedToolChoice

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict] | None    # the tools the chat template renders
    parse_tools: list[dict] | None       # parse the model's own tool-call text against these
    forced: str | None                   # "required" or the named function: the answer is the grammar's JSON
    grammar: dict | None                 # the generate message's grammar spec


def tool_plan(body: ChatRequest) -> ToolPlan:
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    grammar = _response_grammar(body)
    if body.ignore_eos and (grammar is not None or choice == "required" or isinstance(choice, NamedToolChoice)):
        raise ApiError(400, "ignore_eos: a constrained answer ends when its JSON is complete; leave ignore_eos out",
                       "ignore_eos")
    if not tools or choice == "none":
        return ToolPlan(None, None, None, grammar)
    if choice in (None, "auto"):
        return ToolPlan(tools, tools, None, grammar)
    if isinstance(choice, NamedToolChoice):
        fn = next(t["function"] for t in tools if t["function"]["name"] == choice.function.name)
        return ToolPlan(tools, None, fn["name"], _schema_grammar(fn.get("parameters") or ANY_OBJECT,
                                                                 f"tools.{_index(tools, fn['name'])}.function.parameters"))
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "parameters": t["function"].get("parameters") or ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return ToolPlan(tools, None, "required", _schema_grammar(schema, "tools"))


def _index(tools: list[dict], name: str) -> int:
    return next(i for i, t in enumerate(tools) if t["function"]["name"] == name)


def _response_grammar(body: ChatRequest) -> dict | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"kind": "json_object"}
    return _schema_grammar(fmt.json_schema.schema_ or ANY_OBJECT, "response_format.json_schema.schema")


def _schema_grammar(schema: dict, param: str) -> dict:
    from engine.core import grammar

    spec = {"kind": "json_schema", "schema": json.dumps(schema, sort_keys=True)}
    try:
        grammar.check_spec(spec)
    except grammar.GrammarError as exc:
        raise ApiError(400, f"{param}: {exc}", param) from None
    except ImportError:
        raise ApiError(400, f"{param}: constrained decoding needs the xgrammar package on this host "
                            f"(pip install xgrammar)", param) from None
    return spec
