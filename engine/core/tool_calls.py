"""Tool calls in a model's own words -> OpenAI's tool_calls.

The Qwen family writes a call between ``<tool_call>`` and ``</tool_call>``, in one of two forms its chat
templates teach:

- Qwen3.5 / Qwen3-Coder (XML)::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

  A parameter's value is the text between its tags less the one newline the template puts on each
  side; it is converted by the parameter's JSON-schema type (a string stays as written, numbers,
  booleans, objects and arrays are parsed; a value that does not parse stays a string), as vLLM's
  qwen3coder parser does. A missing ``</parameter>`` ends at the next ``<parameter=`` or
  ``</function>``.
- Qwen2.5 / Qwen3 (Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

A block that does not parse is not a call: the caller keeps its text as content (nothing the model
wrote is lost).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str          # a JSON object, as OpenAI sends it


def parse_block(block: str, tools: list[dict] | None = None) -> Call | None:
    """The text between <tool_call> and </tool_call> -> a Call, or None when it is not one."""
    body = block.strip()
    if body.startswith("{"):
        return _hermes(body)
    m = _FUNCTION.search(body)
    if m is None:
        return None
    name = m.group(1).strip()
    types = _param_types(name, tools)
    args = {}
    for pm in _PARAM.finditer(m.group(2)):
        value = pm.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        key = pm.group(1).strip()
        args[key] = _convert(value, types.get(key))
    return Call(name, json.dumps(args, ensure_ascii=False))


def split(text: str, tools: list[dict] | None = None) -> tuple[str, list[Call]]:
    """A whole answer -> (the content outside the calls, the calls in order). A block that does not parse,
    or one the answer left open without its function ever closing, stays in the content as written."""
    content, calls, rest = [], [], text
    while True:
        at = rest.find(OPEN)
        if at < 0:
            content.append(rest)
            break
        content.append(rest[:at])
        end = rest.find(CLOSE, at)
        block = rest[at + len(OPEN):] if end < 0 else rest[at + len(OPEN):end]
        call = parse_block(block, tools) if end >= 0 or "</function>" in block or block.strip().endswith("}") else None
        if call is None:
            content.append(rest[at:] if end < 0 else rest[at:end + len(CLOSE)])
        else:
            calls.append(call)
        if end < 0:
            break
        rest = rest[end + len(CLOSE):]
    text_out = "".join(content)
    return (text_out.strip() if calls else text_out), calls


def _hermes(body: str) -> Call | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return Call(obj["name"], args)
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _param_types(name: str, tools: list[dict] | None) -> dict[str, str | None]:
    for tool in tools or []:
        fn = tool.get("function") or {}
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k: (v.get("type") if isinstance(v, dict) else None) for k, v in props.items()}
    return {}


def _convert(value: str, kind) -> object:
    if isinstance(kind, list):  # ["string", "null"] and the like: the first non-null type
        kind = next((k for k in kind if k != "null"), None)
    if kind in (None, "string"):
        return value
    text = value.strip()
    if kind == "integer":
        try:
            return int(text)
        except ValueError:
            return value
    if kind == "number":
        try:
            number = float(text)
            return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
        except ValueError:
            return value
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), value)
    try:
        return json.loads(text)
    except ValueError:
        return value
