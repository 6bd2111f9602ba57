"""Token choice from full float32 logits: greedy, or temperature + top-p with a seeded generator.

Both ranks hold bit-identical logits and seed the same CPU generator, so they draw
the same token; ``offset`` counts the draws and enters the lockstep hash, so a rank
whose generator drifted is caught even before its tokens differ.
"""

from __future__ import annotations

import torch


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature = temperature
        self.top_p = top_p
        self.generator = torch.Generator(device="cpu").manual_seed(int(seed))
        self.offset = 0

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] (any device, float32) -> token id."""
        logits = logits.detach().to("cpu", torch.float32)
        if self.temperature == 0:
            return int(torch.argmax(logits))  # first maximum on ties, the same on every rank
        probs = torch.softmax(logits / self.temperature, dim=-1)  # [V]
        if self.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < self.top_p  # always keeps the top token
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        self.offset += 1
        return int(torch.multinomial(probs, 1, generator=self.generator))
