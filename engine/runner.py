"""One request's loop, shared by a single process (TP1) and each rank (TP2): chunked prefill, then one
token per step. Hooks see every chunk and every token before it is handed out and may stop the request."""

from __future__ import annotations

from typing import Callable

import torch

from engine.model import Model
from engine.sampling import Sampler

# (phase, index within the phase, tokens of this step, position after it) -> True to cancel
StepHook = Callable[[str, int, list[int], int], bool]


def run(model: Model, prompt_ids: list[int], max_tokens: int, sampler: Sampler, stop_ids: set[int],
        chunk: int, hook: StepHook | None = None, on_token: Callable[[int, int], None] | None = None
        ) -> tuple[list[int], str]:
    """Returns (generated ids, finish_reason in length | stop | cancelled)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if len(prompt_ids) >= model.max_context:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {model.max_context}")
    max_tokens = min(max_tokens, model.max_context - len(prompt_ids))
    logits = None
    for ci, start in enumerate(range(0, len(prompt_ids), chunk)):
        piece = prompt_ids[start:start + chunk]
        logits = model.forward(torch.tensor([piece], device=model.device), start)  # [V]
        if hook and hook("prefill", ci, piece, start + len(piece)):
            return [], "cancelled"
    out: list[int] = []
    pos = len(prompt_ids)
    for k in range(max_tokens):
        tok = sampler(logits)
        if hook and hook("decode", k, [tok], pos + 1):
            return out, "cancelled"
        out.append(tok)
        if on_token:
            on_token(k, tok)
        if tok in stop_ids:
            return out, "stop"
        if k + 1 < max_tokens:
            logits = model.forward(torch.tensor([[tok]], device=model.device), pos)
            pos += 1
    return out, "length"
