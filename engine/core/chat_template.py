"""A model's chat template: where it comes from, and rendering it in jinja2's sandbox.

Where (the first that exists): ``--chat-template FILE``; ``chat_template.jinja`` in the model directory
(as current checkpoints ship it); tokenizer_config.json's ``chat_template``, a string or a list of
``{"name", "template"}`` (``default``, or ``tool_use`` when the request has tools and the list has one,
as transformers chooses).

How: jinja2's ImmutableSandboxedEnvironment with what transformers gives a template
(``raise_exception``, ``strftime_now``, a ``tojson`` filter that keeps non-ASCII text, loop controls,
the ``{% generation %}`` block), so a template can call no Python beyond that: a model's
``{{ cycler.__init__.__globals__.os }}`` is a TemplateError, not a shell. Every failure of a template
(its own ``raise_exception``, a syntax error, an undefined call, the sandbox refusing) is a TemplateError
whose message says what the template said, which the API answers with 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

TEMPLATE_FILE = "chat_template.jinja"


class TemplateError(ValueError):
    """The template cannot render this conversation (its message is the template's own words)."""


@dataclass(frozen=True)
class TemplateSource:
    """Where each available template came from; ``templates`` maps a name to its text."""
    origin: str                     # "--chat-template FILE", "chat_template.jinja", "tokenizer_config.json"
    templates: dict[str, str]

    def pick(self, tools: bool) -> str:
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        return next(iter(self.templates.values()))


def find(model_dir: str | Path, override: str | None = None,
         tokenizer_config: dict | None = None) -> TemplateSource | None:
    """The template of ``model_dir`` (a files directory: config.json and tokenizer files); None when none."""
    if override:
        return TemplateSource(f"--chat-template {override}", {"default": Path(override).read_text()})
    path = Path(model_dir) / TEMPLATE_FILE
    if path.is_file():
        return TemplateSource(TEMPLATE_FILE, {"default": path.read_text()})
    if tokenizer_config is None:
        tc = Path(model_dir) / "tokenizer_config.json"
        tokenizer_config = json.loads(tc.read_text()) if tc.is_file() else {}
    raw = tokenizer_config.get("chat_template")
    if isinstance(raw, str) and raw:
        return TemplateSource("tokenizer_config.json", {"default": raw})
    if isinstance(raw, list):
        named = {t["name"]: t["template"] for t in raw
                 if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
        if named:
            return TemplateSource("tokenizer_config.json", named)
    return None


def check(text: str) -> None:
    """TemplateError when ``text`` is not a template jinja2 can compile."""
    _compile(text)


def render(template: str, messages: list[dict], *, tools: list[dict] | None = None,
           add_generation_prompt: bool = True, special: dict[str, str] | None = None,
           extra: dict[str, Any] | None = None) -> str:
    """The template applied to ``messages`` (and ``tools``, as OpenAI's tool objects); ``extra`` are the
    request's chat_template_kwargs (e.g. enable_thinking), ``special`` the tokenizer's special token strings."""
    import jinja2

    compiled = _compile(template)
    variables: dict[str, Any] = {**(special or {}), **(extra or {})}
    variables.update(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
    try:
        return compiled.render(**variables)
    except TemplateError:
        raise
    except jinja2.exceptions.SecurityError as exc:
        raise TemplateError(f"the chat template tried something its sandbox forbids ({exc})") from None
    except jinja2.exceptions.TemplateError as exc:
        raise TemplateError(f"the chat template failed: {exc}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, RecursionError) as exc:
        raise TemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from None


_CACHE: dict[str, Any] = {}


def _compile(text: str):
    compiled = _CACHE.get(text)
    if compiled is None:
        import jinja2

        try:
            compiled = _environment().from_string(text)
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"the chat template does not compile: {exc}") from None
        if len(_CACHE) > 16:
            _CACHE.clear()
        _CACHE[text] = compiled
    return compiled


def _environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks assistant text with it): its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise TemplateError(f"the chat template refused this conversation: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols],
                                        undefined=jinja2.Undefined)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
