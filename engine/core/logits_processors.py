"""The request's sampling controls beyond temperature and top-p, applied to one step's float32 logits on CPU.

Order (transformers' LogitsProcessorList order for these, and vLLM's for the penalties): logit_bias;
repetition_penalty over every token of the prompt and the output so far (transformers'
RepetitionPenaltyLogitsProcessor: a positive logit divided by it, a negative one multiplied);
presence and frequency penalties over the output so far (OpenAI's formula: logit - count * frequency -
(count > 0) * presence); a grammar's mask (-inf where the grammar forbids); then, in the sampler, the
temperature, top_k (TopKLogitsWarper), top_p, and min_p (MinPLogitsWarper: tokens below min_p times the
top probability go). Greedy decoding takes the argmax of the adjusted logits, so bias, penalties and
the mask act on it too.

Every rank holds the same logits and the same history, so each computes the same numbers (CPU
float32, no threads racing) and draws the same token; the lockstep hash checks that it did.
Log-probabilities reported to the client are those of the model's raw distribution (log-softmax of
the logits before any of this, vLLM's default "raw_logprobs").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Processing:
    top_k: int = 0                          # 0: off
    min_p: float = 0.0                      # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0         # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None             # None: none reported; N >= 0: the chosen token's and the top N
    prompt_ids: tuple[int, ...] = field(default=(), repr=False)

    @classmethod
    def from_message(cls, msg: dict | None, prompt_ids: list[int] | tuple[int, ...] = ()) -> Processing:
        """From a generate message's "sampling" object (engine.service.protocol); ValueError naming what is wrong."""
        msg = dict(msg or {})
        out = cls(top_k=int(msg.pop("top_k", 0) or 0), min_p=float(msg.pop("min_p", 0.0) or 0.0),
                  presence_penalty=float(msg.pop("presence_penalty", 0.0) or 0.0),
                  frequency_penalty=float(msg.pop("frequency_penalty", 0.0) or 0.0),
                  repetition_penalty=float(msg.pop("repetition_penalty", 1.0) or 1.0),
                  logit_bias=tuple((int(k), float(v)) for k, v in msg.pop("logit_bias", None) or ()),
                  logprobs=None if msg.get("logprobs") is None else int(msg.pop("logprobs")),
                  prompt_ids=tuple(int(i) for i in prompt_ids))
        msg.pop("logprobs", None)
        if msg:
            raise ValueError(f"unknown sampling fields {sorted(msg)}")
        out.validate()
        return out

    def validate(self) -> None:
        numbers = (self.min_p, self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
                   *(v for _, v in self.logit_bias))
        if not all(math.isfinite(x) for x in numbers):
            raise ValueError("sampling numbers must be finite")
        if self.top_k < 0 or not 0 <= self.min_p <= 1 or self.repetition_penalty <= 0:
            raise ValueError("top_k must be >= 0, min_p in [0, 1], repetition_penalty > 0")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")

    @property
    def adjusts(self) -> bool:
        """Whether the logits change before the choice (the greedy fast paths are then not exact)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def active(self) -> bool:
        return self.adjusts or bool(self.top_k or self.min_p) or self.logprobs is not None


class History:
    """The tokens a request has so far, as the penalties need them: output counts and the seen set."""

    def __init__(self, processing: Processing, vocab: int):
        self.counts = torch.zeros(vocab, dtype=torch.float32)           # [V] output occurrences
        self.seen = torch.zeros(vocab, dtype=torch.bool)                # [V] prompt or output
        ids = [i for i in processing.prompt_ids if 0 <= i < vocab]
        if ids:
            self.seen[torch.tensor(ids)] = True

    def add(self, token: int) -> None:
        if 0 <= token < self.counts.numel():
            self.counts[token] += 1
            self.seen[token] = True


def adjust(logits: torch.Tensor, p: Processing, history: History | None) -> torch.Tensor:
    """logits [V] float32 CPU -> a new tensor with bias and penalties applied."""
    out = logits.clone()
    if p.logit_bias:
        ids = torch.tensor([i for i, _ in p.logit_bias if 0 <= i < out.numel()], dtype=torch.long)
        vals = torch.tensor([v for i, v in p.logit_bias if 0 <= i < out.numel()], dtype=torch.float32)
        out.index_add_(0, ids, vals)
    if history is not None:
        if p.repetition_penalty != 1.0:
            seen = out[history.seen]
            out[history.seen] = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            out -= history.counts * p.frequency_penalty + (history.counts > 0).float() * p.presence_penalty
    return out


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Logits outside the k largest set to -inf (ties at the k-th value stay, as TopKLogitsWarper keeps them)."""
    if k <= 0 or k >= logits.numel():
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, -math.inf)


def min_p(probs: torch.Tensor, m: float) -> torch.Tensor:
    """Probabilities below m times the largest set to 0 (the largest always stays)."""
    if m <= 0:
        return probs
    return probs.masked_fill(probs < m * probs.max(), 0.0)


def top_logprobs(logits: torch.Tensor, token: int, n: int) -> list:
    """[chosen token's logprob, [[id, logprob], ...] of the n most likely], from the raw logits."""
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    best = torch.topk(lp, n) if n > 0 else None
    top = [] if best is None else [[int(i), _finite(v)] for v, i in zip(best.values.tolist(), best.indices.tolist())]
    return [_finite(float(lp[token])), top]


def _finite(x: float) -> float:
    """JSON has no -inf: a token the model gives no probability at all reports float32's lowest."""
    return x if math.isfinite(x) else -3.4028234663852886e38
