"""Text <-> token ids through a model directory's tokenizer.json (tokenizers library), with its BOS rule
and chat template.

BOS rule: tokenizer_config.json's ``add_bos_token`` when it says so (then the BOS
id is prepended once); otherwise whatever tokenizer.json's post-processor adds
(Llama 3 adds <|begin_of_text|>, Qwen adds nothing).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as _Tok

        from engine.core.config import files_dir

        d = files_dir(model_dir)
        self.files = d
        self.tok = _Tok.from_file(str(d / "tokenizer.json"))
        tc_path = d / "tokenizer_config.json"
        self.tokenizer_config: dict[str, Any] = json.loads(tc_path.read_text()) if tc_path.exists() else {}
        cfg_path = d / "config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.bos_id: int | None = cfg.get("bos_token_id")
        eos = cfg.get("eos_token_id")
        self.eos_ids: list[int] = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
        self.add_bos: bool | None = self.tokenizer_config.get("add_bos_token")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        """None when the directory has no tokenizer.json (then only token ids can be given)."""
        from engine.core.config import files_dir

        return cls(model_dir) if (files_dir(model_dir) / "tokenizer.json").exists() else None

    def encode(self, text: str) -> list[int]:
        """Text -> ids with the model's BOS rule applied."""
        if self.add_bos is None:
            return list(self.tok.encode(text, add_special_tokens=True).ids)
        ids = list(self.tok.encode(text, add_special_tokens=False).ids)
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, *, tools: list[dict] | None = None,
                    extra: dict | None = None, template_file: str | None = None) -> str:
        """The model's chat template (engine.core.chat_template: --chat-template FILE, chat_template.jinja or
        tokenizer_config.json's) applied to ``messages`` in jinja2's sandbox; ValueError (a TemplateError when the
        template itself fails) says why a prompt cannot be built."""
        from engine.core import chat_template

        source = chat_template.find(self.files, template_file, self.tokenizer_config)
        if source is None:
            raise ValueError("this model ships no chat template (no chat_template.jinja, no chat_template in "
                             "tokenizer_config.json): serve it with --chat-template FILE, or send prompts to "
                             "/v1/completions")
        template = source.pick(bool(tools))
        try:
            import jinja2  # noqa: F401
        except ImportError:
            from engine.core import demo

            if template == demo.CHAT_TEMPLATE and not tools and not extra:  # the demo's, rendered without jinja2
                return demo.render_chat(messages, add_generation_prompt)
            raise ValueError("rendering this model's chat template needs the jinja2 package") from None
        return chat_template.render(template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    special=self.special_tokens(), extra=extra)

    def special_tokens(self) -> dict[str, str]:
        """The strings a template may name (eos_token, pad_token, ...). bos_token is "": the encoder adds BOS by
        the model's rule, and a template that writes it too would double it."""
        out = {}
        for key in ("eos_token", "unk_token", "pad_token"):
            value = self.tokenizer_config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                out[key] = value
        return {"eos_token": "", **out, "bos_token": ""}
