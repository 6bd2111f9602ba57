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

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template of tokenizer_config.json applied to ``messages`` (jinja2, as Hugging Face does)."""
        template = self.tokenizer_config.get("chat_template")
        if not template:
            raise ValueError("this model has no chat_template in tokenizer_config.json")
        try:
            import jinja2
        except ImportError:
            from engine.core import demo

            if template == demo.CHAT_TEMPLATE:  # the demo model's template, rendered without jinja2
                return demo.render_chat(messages, add_generation_prompt)
            raise ValueError("rendering this model's chat template needs the jinja2 package") from None
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                bos_token="", eos_token="")
