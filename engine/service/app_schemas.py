"""Request bodies of the OpenAI-compatible API, as pydantic models (FastAPI validates them).

Numbers are strict: "5" is not a max_tokens. Fields the service does not implement
but clients send routinely (user, stream_options, logit_bias, ...) are ignored;
fields that would change the answer and are not implemented (n > 1, logprobs,
echo, best_of > 1) are refused with 400 naming the field.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

# The largest seed both ranks accept as a torch generator seed.
SEED_MAX = 2**63 - 1
# OpenAI documents up to 4 stop sequences.
MAX_STOP = 4
# vLLM's _SAMPLING_EPS, the same number as engine.core.sampling.GREEDY_BELOW (which imports torch,
# so it is not imported here): a temperature below it is greedy.
GREEDY_BELOW = 1e-5


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    # The ranges OpenAI and vLLM accept; finite numbers only (NaN and Infinity are valid in
    # Python's JSON and would reach the sampler otherwise).
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, strict=True, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, strict=True, allow_inf_nan=False)
    seed: StrictInt | None = Field(default=None, ge=0, le=SEED_MAX)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    # As in vLLM's API: keep generating past end-of-sequence tokens, up to max_tokens
    # (load tests and the acceptance suite need requests of a known length).
    ignore_eos: StrictBool = False
    n: StrictInt = 1
    logprobs: object = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, strict=True, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, strict=True, allow_inf_nan=False)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def unsupported(self) -> tuple[str, str] | None:
        """(field, reason) of the first requested feature the service does not implement."""
        if self.n != 1:
            return "n", "only n=1 is served (one sequence per request)"
        if self.logprobs not in (None, False, 0):
            return "logprobs", "log-probabilities are not returned by this engine"
        if self.presence_penalty or self.frequency_penalty:
            field = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            return field, "penalties are not implemented; leave them at 0"
        if len(self.stop_strings()) > MAX_STOP:
            return "stop", f"at most {MAX_STOP} stop sequences"
        return None


class CompletionRequest(_Sampling):
    # A string, or token ids used verbatim (no BOS added), or a one-element list of either.
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not implemented"
        if self.best_of not in (None, 1):
            return "best_of", "only best_of=1 is served"
        if self.suffix:
            return "suffix", "suffix (insertion) is not implemented"
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                return "prompt", "one prompt per request (a batch of prompts is not served)"
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return p[0]
        return p


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class MediaPart(BaseModel):
    """An image, audio or video part (OpenAI's and others' spellings): recognised so it can be refused by name
    (the engine serves a model's text decoder; a multimodal checkpoint's vision tower is not loaded)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "image", "input_image", "input_audio", "audio", "video", "video_url"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart | MediaPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def media(self) -> list[str]:
        """The types of the non-text parts."""
        return [] if isinstance(self.content, str) else [p.type for p in self.content if isinstance(p, MediaPart)]


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
