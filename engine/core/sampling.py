"""Token choice from full float32 logits: greedy, or temperature + top-p with a seeded generator.

Both ranks hold bit-identical logits and seed the same CPU generator, so they draw
the same token; ``offset`` counts the draws and enters the lockstep hash, so a rank
whose generator drifted is caught even before its tokens differ.

The sampler cannot build an invalid distribution: a temperature below GREEDY_BELOW
is greedy (as in vLLM), the top token always survives top-p (however small top_p is,
even below float32's smallest number), and logits that give no finite distribution
(an overflow at a tiny temperature, a NaN) fall back to the argmax for that draw.
"""

from __future__ import annotations

import math

import torch

# vLLM's _SAMPLING_EPS: temperatures below it are treated as 0 (greedy). Dividing logits by
# anything much smaller overflows float32 to inf, and softmax(inf) is NaN.
GREEDY_BELOW = 1e-5


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, processing=None,
                 constraint=None):
        """``processing``: an engine.core.logits_processors.Processing (top_k, min_p, penalties, logit_bias,
        logprobs); ``constraint``: an object with mask(logits) -> logits and accept(token) (engine.core.grammar)."""
        temperature, top_p = float(temperature), float(top_p)
        if not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        if not math.isfinite(top_p) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature = 0.0 if temperature < GREEDY_BELOW else temperature
        self.top_p = top_p
        self.generator = torch.Generator(device="cpu").manual_seed(int(seed))
        self.offset = 0
        self.processing = processing if processing is not None and processing.active else None
        self.constraint = constraint
        self.history = None
        self.logprobs: list | None = None  # the last token's [logprob, top [[id, logprob]...]] when asked

    @property
    def plain(self) -> bool:
        """Temperature and top-p only: the decoder's in-graph greedy path and speculation give the same tokens."""
        return self.processing is None and self.constraint is None

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] (any device, float32) -> token id."""
        raw = logits = logits.detach().to("cpu", torch.float32)
        if not self.plain:
            logits = self._adjust(logits)
        if self.temperature == 0:
            tok = _argmax(logits)
        else:
            probs = self.probs(logits)
            self.offset += 1  # one draw, whichever way it is made: both ranks count the same
            tok = _argmax(logits) if probs is None else int(torch.multinomial(probs, 1, generator=self.generator))
        if not self.plain:
            self._chosen(raw, tok)
        return tok

    def _adjust(self, logits: torch.Tensor) -> torch.Tensor:
        from engine.core import logits_processors as lp

        if self.processing is not None:
            if self.processing.adjusts and self.history is None:
                self.history = lp.History(self.processing, logits.numel())
            logits = lp.adjust(logits, self.processing, self.history)
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        return logits

    def _chosen(self, raw: torch.Tensor, tok: int) -> None:
        from engine.core import logits_processors as lp

        if self.history is not None:
            self.history.add(tok)
        if self.processing is not None and self.processing.logprobs is not None:
            self.logprobs = lp.top_logprobs(raw, tok, self.processing.logprobs)
        if self.constraint is not None:
            self.constraint.accept(tok)

    def probs(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The distribution a draw is made from (temperature > 0): CPU float32 [V] (unnormalised after top-p),
        or None where the logits give no finite distribution (the draw is then the argmax)."""
        logits = logits.detach().to("cpu", torch.float32)
        scaled = logits / self.temperature
        if self.processing is not None and self.processing.top_k:
            from engine.core.logits_processors import top_k

            scaled = top_k(scaled, self.processing.top_k)
        probs = torch.softmax(scaled, dim=-1)  # [V]
        if self.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < self.top_p
            keep[0] = True  # the top token always stays (top_p may round to 0 in float32)
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        if self.processing is not None and self.processing.min_p:
            from engine.core.logits_processors import min_p

            probs = min_p(probs, self.processing.min_p)
        total = float(probs.sum())
        if not (math.isfinite(total) and total > 0) or not bool(torch.isfinite(probs).all()):
            return None
        return probs


def _argmax(logits: torch.Tensor) -> int:
    # First maximum on ties, the same on every rank; NaNs never win.
    return int(torch.argmax(torch.nan_to_num(logits, nan=-math.inf)))
