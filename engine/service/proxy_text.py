"""Text on the proxy side: prompt -> token ids, token ids -> streamed text, stop strings.

The ranks only see and produce token ids; everything about text lives here, in
the proxy process, so both ranks receive byte-identical requests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.core.config import files_dir
from engine.core.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelText:
    model_id: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer: Tokenizer | None        # None without tokenizer.json: token-id prompts only
    template_file: str | None = None   # --chat-template FILE: wins over the model's own template

    def encode_prompt(self, text: str) -> list[int]:
        """The model's BOS rule, then the text's tokens (engine.core.tokenizer, as `generate --prompt`)."""
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer.json: send the prompt as token ids")
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, extra: dict | None = None) -> str:
        """messages (role, content, ... as chat templates read them) -> the prompt text, ending where the
        assistant speaks; ValueError (engine.core.chat_template.TemplateError when the template fails) says why."""
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer.json: use /v1/completions with token ids")
        return self.tokenizer.render_chat(messages, tools=tools, extra=extra, template_file=self.template_file)

    def chat_template(self) -> dict:
        """For /health: where the chat template comes from, or why chat cannot be served."""
        from engine.core import chat_template

        if self.tokenizer is None:
            return {"source": None, "reason": "no tokenizer.json: /v1/chat/completions answers 400"}
        source = chat_template.find(self.tokenizer.files, self.template_file, self.tokenizer.tokenizer_config)
        if source is None:
            return {"source": None, "reason": "the model ships no chat template: /v1/chat/completions answers 400 "
                                              "(serve with --chat-template FILE)"}
        return {"source": source.origin, "names": sorted(source.templates)}


def load_model_text(model_dir: str, served_model_name: str | None, template_file: str | None = None) -> ModelText:
    """From the model directory, or from rank0/ of a `python -m engine shard` directory (its shard.json
    says so; every rank directory holds the same config and tokenizer copies)."""
    root = Path(model_dir)
    files = files_dir(root)
    config = json.loads((files / "config.json").read_text())
    text_cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}  # a multimodal wrapper
    eos = config.get("eos_token_id", text_cfg.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    # The demo model names itself in config.json's "v100plan" block; other models go by their directory.
    model_id = served_model_name or (config.get("v100plan") or {}).get("model_id") or root.name
    return ModelText(model_id=model_id, vocab_size=int(config.get("vocab_size") or text_cfg["vocab_size"]), eos_token_ids=eos_ids,
                     tokenizer=Tokenizer.from_dir(files), template_file=template_file)


def reasoning_parser(mode: str, text: ModelText) -> bool:
    """--reasoning-parser: whether <think>...</think> is returned apart (auto: the vocabulary has </think>)."""
    if mode != "auto":
        return mode == "qwen3"
    return text.tokenizer is not None and text.tokenizer.tok.token_to_id("</think>") is not None


class TextAssembler:
    """Turns rank 0's token ids into text deltas, honouring stop strings.

    Text is re-decoded from all ids each step (so multi-token characters come out
    whole) and held back while it could still be the start of a stop string or
    ends in an incomplete character.
    """

    def __init__(self, text: ModelText, stop_strings: list[str], hidden_ids: tuple[int, ...]):
        self.text = text
        self.stops = stop_strings
        self.hold = max((len(s) for s in stop_strings), default=1) - 1
        self.hidden = set(hidden_ids)      # end-of-sequence ids: they end the answer, they are not text
        self.ids: list[int] = []           # every token id rank 0 produced
        self.emitted = ""
        self.final: str | None = None      # set once a stop string matched
        self._visible: list[int] = []

    @property
    def stopped(self) -> bool:
        return self.final is not None

    def add(self, token_id: int) -> str:
        """Feed one token; returns the text that may be shown now ('' when held back)."""
        self.ids.append(token_id)
        if self.stopped:
            return ""
        if token_id in self.hidden:
            return ""
        self._visible.append(token_id)
        full = self.text.decode(self._visible)
        for stop in self.stops:
            at = full.find(stop, max(0, len(self.emitted) - len(stop)))
            if at >= 0 and (self.final is None or at < len(self.final)):
                self.final = full[:at]
        if self.final is not None:
            return self._emit(self.final)
        safe = len(full) - self.hold
        while safe > 0 and full[safe - 1] == "\ufffd":
            safe -= 1
        return self._emit(full[:max(safe, len(self.emitted))])

    def flush(self) -> str:
        """At the end of the request: whatever was held back."""
        if self.final is not None:
            return self._emit(self.final)
        return self._emit(self.text.decode(self._visible))

    def _emit(self, upto: str) -> str:
        if not upto.startswith(self.emitted) or len(upto) <= len(self.emitted):
            return ""
        delta = upto[len(self.emitted):]
        self.emitted = upto
        return delta
