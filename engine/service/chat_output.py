"""A chat answer's text, as it streams, split into what OpenAI's chat API returns apart: the reasoning
(``reasoning_content``, as vLLM's Qwen3 reasoning parser names it), the content, and tool calls.

Reasoning: the answer is reasoning from its start when the prompt ends inside an open ``<think>`` (a
Qwen3.5 template with thinking on writes ``<think>\\n`` as the generation prompt), or from a ``<think>``
it opens itself first thing; reasoning ends at ``</think>`` (newlines right after it are dropped, as the
family's templates drop them when the turn comes back). With thinking off the template closes the
block in the prompt, so the answer is content. The parser ``none`` leaves everything in the content.

Tool calls (tools given, tool_choice auto): from the first ``<tool_call>`` on, each complete block
is parsed (engine.core.tool_calls) and sent as one ``tool_calls`` delta (name and whole arguments);
a block that does not parse goes out as content. Under tool_choice required or a named function the
answer is JSON the grammar enforced (engine.service.constrained): the calls are read from it at the end.

Text that could still be the start of a tag is held back, so no delta ever carries half a tag.
"""

from __future__ import annotations

import json
import uuid

from engine.core import tool_calls

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """The rendered prompt ends inside a <think> block (the model's answer starts as reasoning)."""
    at = prompt.rfind(THINK_OPEN)
    return at >= 0 and prompt.find(THINK_CLOSE, at) < 0


def _held(buf: str, tag: str) -> int:
    """How many trailing characters of buf could begin ``tag``."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-n:]):
            return n
    return 0


class ChatOutput:
    def __init__(self, *, reasoning: str = "none", tools: list[dict] | None = None,
                 forced: str | None = None, names: list[str] | None = None):
        """``reasoning``: "open" (the prompt left a <think> open), "detect" (a <think> first thing opens one) or
        "none"; ``tools``: parse tool calls in the model's own format; ``forced``: "required" or a function
        name: the whole answer is the JSON the grammar enforced (``names``: the tools' names)."""
        self.phase = {"open": "reasoning", "detect": "start"}.get(reasoning, "content")
        self.tools = tools
        self.forced = forced
        self.buf = ""
        self.strip_newlines = False
        self.reasoning, self.content = "", ""
        self.calls: list[dict] = []

    # ----- streaming ----------------------------------------------------------------------------

    def feed(self, text: str) -> list[dict]:
        """The answer's next text -> the deltas that may go out now."""
        self.buf += text
        out: list[dict] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[dict]:
        """At the end: everything held back, and the calls of a forced answer."""
        out: list[dict] = []
        rest, self.buf = self.buf, ""
        if self.forced is not None:
            self._forced_calls(rest, out)
        elif self.phase == "reasoning":
            self._emit(out, "reasoning_content", rest)
        elif self.phase == "calls":
            content, calls = tool_calls.split(rest, self.tools)
            for call in calls:
                self._call(out, call.name, call.arguments)
            self._emit(out, "content", content if content.strip() else "")
        else:
            self._emit(out, "content", rest)
        return out

    def message(self) -> dict:
        """The whole answer as a chat message (after finish())."""
        msg: dict = {"role": "assistant", "content": self.content if (self.content or not self.calls) else None}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg

    # ----- the phases -------------------------------------------------------------------------

    def _step(self, out: list[dict]) -> bool:
        """One move on the buffer; True when another may follow."""
        if self.forced is not None:
            return False  # all at the end
        if self.strip_newlines:
            stripped = self.buf.lstrip("\n")
            if not stripped:
                self.buf = ""
                return False
            self.buf, self.strip_newlines = stripped, False
        if self.phase == "reasoning":
            at = self.buf.find(THINK_CLOSE)
            if at < 0:
                keep = _held(self.buf, THINK_CLOSE)
                self._emit(out, "reasoning_content", self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return False
            self._emit(out, "reasoning_content", self.buf[:at])
            self.buf = self.buf[at + len(THINK_CLOSE):]
            self.phase, self.strip_newlines = "content", True
            return True
        if self.phase == "start":
            head = self.buf.lstrip()
            if head.startswith(THINK_OPEN):
                self.buf = head[len(THINK_OPEN):]
                self.phase, self.strip_newlines = "reasoning", True
                return True
            if not head or THINK_OPEN.startswith(head):
                return False  # still could be "<think>"
            self.phase = "content"
            return True
        if self.phase == "content":
            if self.tools is None:
                self._emit(out, "content", self.buf)
                self.buf = ""
                return False
            at = self.buf.find(tool_calls.OPEN)
            if at < 0:
                keep = _held(self.buf, tool_calls.OPEN)
                self._emit(out, "content", self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return False
            self._emit(out, "content", self.buf[:at])
            self.buf = self.buf[at:]
            self.phase = "calls"
            return True
        # calls: send each block as soon as it closes
        end = self.buf.find(tool_calls.CLOSE)
        if end < 0:
            return False
        block, self.buf = self.buf[:end + len(tool_calls.CLOSE)], self.buf[end + len(tool_calls.CLOSE):]
        content, calls = tool_calls.split(block, self.tools)
        for call in calls:
            self._call(out, call.name, call.arguments)
        self._emit(out, "content", content if content.strip() else "")
        return True

    def _emit(self, out: list[dict], key: str, text: str) -> None:
        if not text:
            return
        if key == "content":
            self.content += text
        else:
            self.reasoning += text
        out.append({key: text})

    def _call(self, out: list[dict], name: str, arguments: str) -> None:
        call = {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": name, "arguments": arguments}}
        self.calls.append(call)
        out.append({"tool_calls": [{"index": len(self.calls) - 1, **call}]})

    def _forced_calls(self, text: str, out: list[dict]) -> None:
        """A named function's answer is its arguments object; required's is [{"name", "parameters"}, ...]."""
        try:
            value = json.loads(text)
        except ValueError:
            self._emit(out, "content", text)  # cut short (max_tokens): the text as it is
            return
        if self.forced == "required" and isinstance(value, list):
            for item in value:
                self._call(out, item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
        elif self.forced != "required":
            self._call(out, self.forced, json.dumps(value, ensure_ascii=False))
        else:
            self._emit(out, "content", text)
