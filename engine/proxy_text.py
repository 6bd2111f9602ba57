"""Text on the proxy side: prompt -> token ids, token ids -> streamed text, stop strings.

The ranks only see and produce token ids; everything about text lives here, in
the proxy process, so both ranks receive byte-identical requests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelText:
    model_id: str
    vocab_size: int
    bos_token_id: int | None
    add_bos: bool
    eos_token_ids: tuple[int, ...]
    chat_template: dict | None         # see render_chat
    tokenizer: object | None           # tokenizers.Tokenizer, None without tokenizer.json

    def encode_prompt(self, text: str) -> list[int]:
        """The model's BOS rule, then the text's tokens (no other special tokens)."""
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer.json: send the prompt as token ids")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_token_id] if self.add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def render_chat(self, messages: list[tuple[str, str]]) -> str:
        """messages as (role, text) -> the prompt text, ending where the assistant speaks.

        The template is plain data (no code): {"message": "<|{role}|>{content}\\n",
        "generation_prompt": "<|assistant|>"}; without one, a neutral "role: text" layout.
        """
        tpl = self.chat_template or {"message": "{role}: {content}\n", "generation_prompt": "assistant:"}
        body = "".join(tpl["message"].replace("{role}", role).replace("{content}", text) for role, text in messages)
        return body + tpl.get("generation_prompt", "")


def load_model_text(model_dir: str, served_model_name: str | None) -> ModelText:
    root = Path(model_dir)
    config = json.loads((root / "config.json").read_text())
    tokenizer = None
    if (root / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    v100plan = config.get("v100plan") or {}
    model_id = served_model_name or v100plan.get("served_model_id") or config.get("served_model_id") or root.name
    return ModelText(
        model_id=model_id,
        vocab_size=int(config["vocab_size"]),
        bos_token_id=config.get("bos_token_id"),
        add_bos=bool(v100plan.get("add_bos", config.get("add_bos_token", config.get("bos_token_id") is not None))),
        eos_token_ids=eos_ids,
        chat_template=v100plan.get("chat_template") or config.get("chat_template"),
        tokenizer=tokenizer,
    )


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
