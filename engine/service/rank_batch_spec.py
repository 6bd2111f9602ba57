"""MTP speculation in the batch loop (``serve --max-concurrency N --speculative mtp``; docs/service.md, "Concurrent
requests").

Each speculating sequence (greedy or plain sampling, no images: as one request at a time speculates) runs the
one-at-a-time eager round of engine.core.mtp in its own slot, one sequence after another inside the batch loop's
round: the draft layer proposes K tokens over the slot's own draft-layer K/V, one Model.forward of the K + 1
positions verifies them (the slot's K/V, conv rings and recurrent states), the accepted ones are kept and the
linear-attention states of the slot roll back to the last accepted position. Not one batched verification for all
slots: a Gated DeltaNet row's state after position p feeds position p + 1, which Model.decode_batch's one row per
slot cannot chain (the current limit). The prompt's prefill feeds the draft layer chunk by chunk (mtp.Prefill).
With a prefix cache the draft layer keeps up with every position its slot holds (the one-at-a-time rule,
engine.core.prefix ``drafted``), so a follow-up reusing the slot drafts as a cold request does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core import mtp


@dataclass(eq=False)
class SlotSpec:
    """A speculating sequence's draft-layer bookkeeping: its prefill's feed, then the inputs the draft layer has
    not run over yet (tokens at positions pos + 1.., with the model's hidden states at pos..)."""
    prefill: mtp.Prefill
    tokens: list | None = None
    hidden: torch.Tensor | None = None
    pos: int = 0
    counts: dict = field(default_factory=lambda: {"draft_tokens": 0, "accepted_tokens": 0, "rounds": 0})

    def prefilled(self, n: int) -> None:
        """The prompt's last chunk ran: the draft layer waits for the first token with the last hidden state."""
        self.hidden, self.pos = self.prefill.pending[None], n - 1


def start(loop, seq, ids: list[int], first: int) -> SlotSpec:
    return SlotSpec(mtp.Prefill(loop.model, ids, first, loop.store(seq.slot)))


def run(loop, seq) -> list[int]:
    """One speculative round of ``seq`` (its pending token at seq.pos) in its slot -> the tokens it gives (the
    accepted drafts and the model's next token); the sequence's position moves past the accepted ones."""
    model, sp, store = loop.model, seq.spec, loop.store(seq.slot)
    tok, pos = seq.pending, seq.pos
    if sp.tokens is None:  # the first round: the draft layer's input is the first token
        sp.tokens = [tok]
    kk = min(loop.spec_k, seq.max_tokens - len(seq.out) - 1)  # drafts past the last token asked for are wasted
    keep = store is not None  # a round without drafts still runs the draft layer over the last round's positions
    with loop.in_slot(seq.slot):
        drafts, qs = (mtp.draft(model, seq.sampler, kk, sp.tokens, sp.hidden, sp.pos) if kk or keep else ([], []))
        states: list = []
        logits, hid = model.forward(torch.tensor([[tok] + drafts], device=model.device), pos, all_logits=True,
                                    hidden=True, states=states)
        a, nxt = mtp.accept(seq.sampler, drafts, qs, logits)
        if a < len(drafts):
            mtp.rollback(model, states, a)
    if store is not None:
        store.fed(([tok] + drafts)[:a + 1], pos)  # the slot holds [tok, d1..da] at pos..pos+a
    sp.counts["draft_tokens"] += len(drafts)
    sp.counts["accepted_tokens"] += a
    sp.counts["rounds"] += 1
    sp.tokens, sp.hidden, sp.pos = drafts[:a] + [nxt], hid[:a + 1], pos
    seq.pos, seq.pending = pos + a + 1, None
    return drafts[:a] + [nxt]


def catch_up(loop, seq) -> None:
    """A finished speculating sequence with a prefix cache: the draft layer over its last positions, so it holds
    every position the slot does (plus one), as the one-at-a-time decode leaves it."""
    store, sp = loop.store(seq.slot), seq.spec
    if store is None or sp.hidden is None or not seq.out:
        return  # no first token yet: the prefill told the cache what the draft layer ran over
    tokens = sp.tokens if sp.tokens is not None else [seq.out[0]]
    with loop.in_slot(seq.slot):
        model = loop.model
        model.mtp.forward(model, tokens, sp.hidden, sp.pos)
    store.drafted = store.live[:sp.pos + 1] + tokens
