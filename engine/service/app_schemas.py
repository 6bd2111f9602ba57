"""Request bodies of the OpenAI-compatible API, as pydantic models (FastAPI validates them).

Every field OpenAI defines for /v1/completions and /v1/chat/completions is declared here, so the
OpenAPI schema lists it: either implemented, or refused with 400 naming it when a client asks for
something the service does not do (``unsupported()``; docs/service.md has the table). A field
OpenAI does not define and the service does not take (a typo, another server's extension) is a
400 naming it too, as OpenAI answers "Unrecognized request argument". Nothing is silently ignored
except the fields that never change an answer (``user``, ``metadata``, ...), which are listed.

Numbers are strict: "5" is not a max_tokens, but 1.0 is an integer (as JSON Schema says).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr

# The largest seed both ranks accept as a torch generator seed.
SEED_MAX = 2**63 - 1
# OpenAI documents up to 4 stop sequences.
MAX_STOP = 4
# vLLM's _SAMPLING_EPS, the same number as engine.core.sampling.GREEDY_BELOW (which imports torch,
# so it is not imported here): a temperature below it is greedy.
GREEDY_BELOW = 1e-5
# OpenAI's limits: top_logprobs 0..20 (chat), logprobs 0..5 (completions), logit_bias values -100..100.
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
LOGIT_BIAS_LIMIT = 100.0


def _integral(value: Any) -> Any:
    """JSON Schema's integer includes 1.0; a bool or a string is not one."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[StrictInt, BeforeValidator(_integral)]
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class _Strict(BaseModel):
    """Unknown fields are kept so that they can be refused by name (``unknown_field``)."""
    model_config = ConfigDict(extra="allow")

    def unknown_field(self, prefix: str = "") -> str | None:
        extra = self.model_extra or {}
        return f"{prefix}{next(iter(extra))}" if extra else None


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    include_obfuscation: StrictBool = False
    # vLLM's extension, with vLLM's meaning: with include_usage, every chunk carries the usage so far
    # (guidellm sends it on every streamed request).
    continuous_usage_stats: StrictBool = False


class _Sampling(_Strict):
    model: StrictStr
    max_tokens: Int | None = Field(default=None, ge=1)
    # The ranges OpenAI and vLLM accept; finite numbers only (NaN and Infinity are valid in
    # Python's JSON and would reach the sampler otherwise).
    temperature: Float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Float = Field(default=1.0, gt=0.0, le=1.0)
    seed: Int | None = Field(default=None, ge=0, le=SEED_MAX)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Int = Field(default=1, ge=1)
    presence_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[StrictStr, Float] | None = None
    user: StrictStr | None = Field(default=None, description="accepted; never changes an answer")
    # vLLM's extensions, with vLLM's meaning.
    # Keep generating past end-of-sequence tokens, up to max_tokens (load tests and the acceptance
    # suite need requests of a known length).
    ignore_eos: StrictBool = False
    top_k: Int | None = Field(default=None, ge=-1)
    min_p: Float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: Float = Field(default=1.0, gt=0.0, le=2.0)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def top_k_value(self) -> int:
        """0: off (OpenAI sends none; vLLM spells off -1 or 0)."""
        return max(0, self.top_k or 0)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats, which counts only with include_usage."""
        return self.include_usage() and bool(self.stream_options.continuous_usage_stats)

    def unsupported(self) -> tuple[str, str] | None:
        """(field, reason) of the first requested feature the service does not implement."""
        unknown = self.unknown_field()
        if unknown is not None:
            return unknown, (f"unrecognized request argument {unknown!r}: this service takes the fields "
                             f"docs/service.md lists (OpenAI's, and vLLM's ignore_eos, top_k, min_p, "
                             f"repetition_penalty, chat_template_kwargs)")
        if self.stream_options is not None:
            if not self.stream:
                return "stream_options", "stream_options is only allowed with stream: true"
            bad = self.stream_options.unknown_field("stream_options.")
            if bad:
                return bad, f"unrecognized request argument {bad!r}"
        if self.n != 1:
            return "n", "only n=1 is served (one sequence per request; send n requests with different seeds)"
        if len(self.stop_strings()) > MAX_STOP:
            return "stop", f"at most {MAX_STOP} stop sequences"
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit():
                return "logit_bias", f"logit_bias keys are token ids (strings of digits), got {key!r}"
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                return "logit_bias", f"logit_bias values must be in [-100, 100], got {value} for token {key}"
        return None


class CompletionRequest(_Sampling):
    # A string, or token ids used verbatim (no BOS added), or a one-element list of either.
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    echo: StrictBool = False
    best_of: Int | None = None
    suffix: StrictStr | None = None
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    def unsupported(self) -> tuple[str, str] | None:
        problem = super().unsupported()
        if problem is not None:
            return problem
        if self.echo:
            return "echo", "echo is not implemented"
        if self.best_of not in (None, 1):
            return "best_of", "only best_of=1 is served"
        if self.suffix:
            return "suffix", "suffix (insertion) is not implemented"
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                return "prompt", "one prompt per request (a batch of prompts is not served)"
        return None

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return p[0]
        return p

    def top_logprobs_count(self) -> int | None:
        """None: no log-probabilities; N: the chosen token's and the N most likely ones."""
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class MediaPart(BaseModel):
    """An image, audio, video or file part (OpenAI's and others' spellings): recognised so it can be refused by
    name (the engine serves a model's text decoder; a multimodal checkpoint's vision tower is not loaded)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "image", "input_image", "input_audio", "audio", "video", "video_url", "file",
                  "refusal"]


class FunctionCall(_Strict):
    name: StrictStr
    arguments: StrictStr


class ToolCall(_Strict):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart | MediaPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None       # an assistant's earlier calls
    tool_call_id: StrictStr | None = None          # a tool's answer names the call it answers
    reasoning_content: StrictStr | None = None     # an assistant's earlier reasoning (vLLM's field), for the template

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def media(self) -> list[str]:
        """The types of the non-text parts."""
        return [] if not isinstance(self.content, list) else [p.type for p in self.content if isinstance(p, MediaPart)]

    def problem(self) -> tuple[str, str] | None:
        """(sub-field, reason) of what this message cannot carry."""
        unknown = self.unknown_field()
        if unknown is not None:
            return unknown, f"unrecognized message field {unknown!r}"
        if self.role == "tool" and not self.tool_call_id:
            return "tool_call_id", "a role 'tool' message must name the call it answers (tool_call_id)"
        if self.role != "tool" and self.tool_call_id is not None:
            return "tool_call_id", "only a role 'tool' message carries tool_call_id"
        if self.tool_calls and self.role != "assistant":
            return "tool_calls", "only an assistant message carries tool_calls"
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            return "content", "content is required (only an assistant message with tool_calls may leave it out)"
        return None

    def for_template(self) -> dict:
        """The message as chat templates read it (Hugging Face's convention: arguments as a dict)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": _arguments(c.function.arguments)}}
                                 for c in self.tool_calls]
        return out


def _arguments(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDef(_Strict):
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extension: extra variables for the chat template (e.g. {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None
    # Fields that never change an answer: accepted, recorded nowhere.
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    modalities: list[StrictStr] | None = None
    # OpenAI fields this service refuses when given (see unsupported()).
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_count(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                return -1  # refused in unsupported()
            return None
        return self.top_logprobs or 0

    def unsupported(self) -> tuple[str, str] | None:
        problem = super().unsupported()
        if problem is not None:
            return problem
        refused = {
            "audio": "audio output is not produced (the service serves a text model)",
            "prediction": "predicted outputs are not implemented",
            "web_search_options": "web search is not a feature of this service",
            "functions": "the deprecated functions field is not served: send tools",
            "function_call": "the deprecated function_call field is not served: send tool_choice",
            "reasoning_effort": "reasoning effort is not adjustable: send chat_template_kwargs "
                                "{\"enable_thinking\": false} to switch a thinking model's reasoning off",
            "verbosity": "verbosity is not adjustable",
        }
        for name, why in refused.items():
            if getattr(self, name) is not None:
                return name, why
        if self.store:
            return "store", "completions are not stored by this service (send store: false or leave it out)"
        if self.service_tier not in (None, "auto", "default"):
            return "service_tier", "one service tier is served: auto (or default)"
        if self.modalities not in (None, ["text"]):
            return "modalities", "only text output is produced: send [\"text\"] or leave it out"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            return "tool_choice", "tool_choice needs tools"
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                return "tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, not among tools {names}"
        fmt = self.response_format
        if fmt is not None:
            if fmt.type == "json_schema" and fmt.json_schema is None:
                return "response_format.json_schema", "response_format json_schema needs its json_schema object"
            if fmt.type != "text" and self.tools and self.tool_choice not in (None, "none"):
                return "response_format", "response_format and tools cannot both constrain one answer"
        for i, m in enumerate(self.messages):
            bad = m.problem()
            if bad is not None:
                return f"messages.{i}.{bad[0]}", bad[1]
        for i, t in enumerate(self.tools or []):
            bad = t.unknown_field() or t.function.unknown_field("function.")
            if bad is not None:
                return f"tools.{i}.{bad}", f"unrecognized tool field {bad!r}"
        return None

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]
