"""MTP speculative decoding: the checkpoint's own draft layer proposes K tokens, one forward of the model over
the K + 1 positions verifies them.

The draft layer as Qwen3.5 / Qwen3-Next checkpoints carry it (``mtp.*``, config ``mtp_num_hidden_layers``; vLLM's
qwen3_next_mtp.py reads it the same way): at position p it takes the embedding of token p + 1 and the model's
hidden state at p (the output of the final norm, what the head reads) and predicts token p + 2:

    x = fc(cat(norm_e(embed(token[p + 1])), norm_h(hidden[p])))     fc [D, 2D], zero-centred norms
    x = one full-attention decoder layer (gated attention, its own K/V cache at position p, MLP)
    hidden' = norm(x); logits = the model's head(hidden')            the embedding and head are the model's

Drafting k > 1 tokens feeds hidden' back in as the hidden state of the next position. Under TP2 fc is
replicated and the layer splits as the decoder's (heads, MLP columns; two allreduces).

A round (``decode``): drafts d1..dK from the last token t; the model runs [t, d1..dK] at positions pos..pos+K in
one forward (Model.forward with ``states``: all logits, the hidden states, the linear-attention states after each
position); greedy accepts the longest prefix of drafts that equals the model's argmax, plus the model's own next
token (the bonus): the tokens are exactly those of one-token decoding. Sampling accepts draft x with probability
min(1, p(x) / q(x)) and otherwise draws from norm(max(p - q, 0)) (Leviathan et al. 2023), which leaves the
distribution of every token that of p; every draw uses the Sampler's generator so TP2 ranks draw alike. The
linear-attention states roll back to the last accepted position; K/V written past it is overwritten by the next
round before any query can see it (attention reads positions up to its own only).

That is the eager round (CPU, and paths that cannot be captured). On CUDA graphs the same round replays
engine.core.spec_graphs' captured steps (``graph_round``): the draft graph, the verification graph of K + 1
positions, one read-back, the rollback graph; the tokens are the eager round's.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from engine.core.sampling import Sampler, _argmax
from engine.core.speculative import MAX_DRAFT_TOKENS


def check_draft_tokens(model, k: int) -> None:
    """ValueError unless speculation with ``k`` drafts can run on this model."""
    if not 1 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(f"draft tokens must be 1 to {MAX_DRAFT_TOKENS}, got {k}")
    if getattr(model, "mtp", None) is None:
        raise ValueError("speculative decoding with mtp needs a model whose config.json declares an MTP layer "
                         "(mtp_num_hidden_layers) and whose checkpoint carries its mtp.* tensors (a demo: python -m engine "
                         "make-demo-model DIR --arch qwen3_5 --mtp)")


class Prefill:
    """The draft layer's K/V over the prompt, chunk by chunk as the model prefills it: position p pairs the
    model's hidden state at p with prompt token p + 1; the last prompt position waits for the first token.
    ``prefix`` (an engine.core.prefix.PrefixCache, or None) is told which tokens the draft layer has run over."""

    def __init__(self, model, prompt: list[int], first: int, prefix=None):
        self.model, self.prompt, self.prefix = model, prompt, prefix
        self.pending: torch.Tensor | None = None  # the hidden state of the position before the next chunk
        self.first = first  # positions before it were reused: the prefix cache holds the draft layer's K/V there

    def chunk(self, start: int, hidden: torch.Tensor) -> None:
        """The model prefilled prompt[start:start + T] with final-norm output ``hidden`` [T, D]."""
        end = start + hidden.shape[0]
        if self.pending is not None:
            hs, pos0 = torch.cat([self.pending[None], hidden[:-1]]), start - 1
        else:
            hs, pos0 = hidden[:-1], start
        if hs.shape[0]:
            self.model.mtp.forward(self.model, self.prompt[pos0 + 1:end], hs, pos0)
            if self.prefix is not None:
                self.prefix.drafted = list(self.prompt[:end])  # positions [0, end - 1)
        self.pending = hidden[-1]


def rollback(model, states: list, i: int) -> None:
    """The linear-attention layers' states as they were after position index ``i`` of a verification."""
    it = iter(states)
    for layer in model.layers:
        if layer.kind == "linear_attention":
            rings, recs = next(it)
            layer.conv_ring.copy_(rings[i])
            layer.rec_state.copy_(recs[i])


def _one_hot(logits: torch.Tensor) -> torch.Tensor:
    p = torch.zeros(logits.shape[-1], dtype=torch.float32)
    p[_argmax(logits.detach().cpu().float())] = 1.0
    return p


def _dist(sampler: Sampler, logits: torch.Tensor) -> torch.Tensor:
    """The normalised distribution the sampler draws from (the argmax's one-hot where it has none)."""
    p = sampler.probs(logits)
    return _one_hot(logits) if p is None else p / p.sum()


def _draw(sampler: Sampler, p: torch.Tensor) -> int:
    sampler.offset += 1  # one draw: the lockstep record counts it on both ranks
    return int(torch.multinomial(p, 1, generator=sampler.generator))


def accept(sampler: Sampler, drafts: list[int], qs: list[torch.Tensor | None], logits: torch.Tensor) -> tuple[int, int]:
    """(accepted drafts a, the next token) from the verification's logits [K + 1, V]. Greedy: the drafts that
    equal the argmax, then the argmax after them. Sampling: the rejection rule with draft distributions ``qs``."""
    if sampler.temperature == 0:
        a = 0
        while a < len(drafts) and sampler(logits[a]) == drafts[a]:
            a += 1
        return a, sampler(logits[a])
    for j, (x, q) in enumerate(zip(drafts, qs)):
        p = _dist(sampler, logits[j])
        u = float(torch.rand((), generator=sampler.generator))
        sampler.offset += 1
        if u * float(q[x]) < float(p[x]):  # u < p(x) / q(x), without dividing
            continue
        r = torch.clamp(p - q, min=0.0)
        return j, _draw(sampler, r / r.sum() if float(r.sum()) > 0 else p)
    return len(drafts), _draw(sampler, _dist(sampler, logits[len(drafts)]))


def draft(model, sampler: Sampler, k: int, tokens: list[int], hidden: torch.Tensor,
          pos0: int) -> tuple[list[int], list[torch.Tensor | None]]:
    """k drafts after the pending draft-layer inputs (tokens/hidden at pos0..): the first from their last row,
    each next one from the previous draft and the layer's own hidden state. Greedy drafts are the argmax (no
    distribution kept); sampled ones are drawn from q, which is returned for the rejection rule."""
    drafts: list[int] = []
    qs: list[torch.Tensor | None] = []
    pos = pos0 + len(tokens)  # where the next one-token step of the draft layer sits
    hs, logits = model.mtp.forward(model, tokens, hidden, pos0)
    for j in range(k):
        if sampler.temperature == 0:
            x, q = _argmax(logits[-1].cpu()), None
        else:
            q = _dist(sampler, logits[-1])
            x = _draw(sampler, q)
        drafts.append(x)
        qs.append(q)
        if j + 1 < k:
            hs, logits = model.mtp.forward(model, [x], hs[-1:], pos + j, step=j + 1)
    return drafts, qs


Hook = Callable[[str, int, list[int], int], bool]


def graph_round(model, decoder, sg, sampler: Sampler, kk: int, m_tokens: list[int], m_pos: int,
                pos: int, keep: bool = False) -> tuple[list[int], int, int]:
    """One round on ``decoder.spec``'s graphs (engine.core.spec_graphs): the drafts (the draft graph when greedy
    and the round's positions fit; else drafted eagerly and written into the static tokens), the verification
    graph, one read-back, the rollback graph where a draft was rejected. -> (drafts, accepted a, next token).
    ``keep``: the draft layer runs over the last round's positions even when this round drafts nothing."""
    k = sg.k
    window = decoder.window_for(min(pos + k, model.max_context - 1))
    greedy = sampler.temperature == 0
    qs: list = []
    if greedy and pos + k - 1 < model.max_context:
        sg.replay_draft(len(m_tokens), window)  # K drafts; the verification reads the first kk
    else:
        drafts, qs = (globals()["draft"](model, sampler, kk, m_tokens, sg.hid[:len(m_tokens)], m_pos)
                      if kk or keep else ([], []))
        sg.tok[:kk + 1].copy_(torch.tensor([m_tokens[-1]] + drafts))
        sg.pos.fill_(pos)
    logits = sg.replay_verify(kk, window)
    vals = sg.out.tolist()  # the round's one host sync: [tokens | the verification's argmax per row]
    decoder.after_step()  # a GPU-side allreduce wait that timed out in these graphs fails here, in its round
    drafts, top = vals[1:kk + 1], vals[k + 1:]
    if greedy:
        a = 0
        while a < kk and top[a] == drafts[a]:
            a += 1
        nxt = top[a]
    else:
        a, nxt = accept(sampler, drafts, qs, logits)
    if a < kk:
        sg.replay_rollback(a)
    return drafts, a, nxt


def decode(model, decoder, logits: torch.Tensor, pending: torch.Tensor, n: int, max_tokens: int, sampler: Sampler,
           stop_ids: set[int], k: int, hook: Hook | None, on_token: Callable[[int, int], None] | None,
           info: dict | None, prefix=None) -> tuple[list[int], str]:
    """The speculative decode loop after a prefill of ``n`` prompt tokens (``logits`` [V] of the last one,
    ``pending`` its final-norm hidden state). Returns what runner.run returns. The drafts come from the module's
    ``draft`` (looked up per round: tests plug other proposals in there). With a ``prefix`` cache the draft layer
    keeps up with every position the model holds (the last round's too, after the loop), so that a later request
    reusing them drafts exactly as a cold one."""
    spec = {"draft_tokens": 0, "accepted_tokens": 0, "rounds": 0}
    if info is not None:
        info["spec"] = spec
    out: list[int] = []

    def emit(tok: int, pos_after: int) -> str | None:
        decoder.checked = None  # no in-graph check of these tokens: the hook exchanges a record for each
        if hook and hook("decode", len(out), [tok], pos_after):
            return "cancelled"
        out.append(tok)
        if on_token:
            on_token(len(out) - 1, tok)
        if tok in stop_ids:
            return "stop"
        return "length" if len(out) >= max_tokens else None

    tok = decoder.sample(sampler, logits)
    decoder.after_step()
    pos = n  # where tok goes into the model
    done = emit(tok, pos + 1)
    m_tokens, m_hidden, m_pos = [tok], pending[None], n - 1  # the draft layer's inputs not yet run
    sg = getattr(decoder, "spec", None)
    if sg is not None and sg.k != k:
        sg = None  # captured for another draft count: eager rounds
    keep = prefix is not None  # a round without drafts still runs the draft layer over the last round's positions
    if sg is not None:  # the first round's draft-layer inputs, where the graphs read them
        sg.argmax[:1].fill_(tok)
        sg.hid[:1].copy_(pending[None])
        sg.pos.fill_(m_pos)
    while done is None:
        t0 = time.perf_counter()
        kk = min(k, max_tokens - len(out) - 1)  # drafts past the last token asked for are wasted
        if sg is not None:
            drafts, a, nxt = graph_round(model, decoder, sg, sampler, kk, m_tokens, m_pos, pos, keep)
            hid = sg.hid
        else:
            drafts, qs = (globals()["draft"](model, sampler, kk, m_tokens, m_hidden, m_pos)
                          if kk or keep else ([], []))
            states: list = []
            all_logits, hid = model.forward(torch.tensor([[tok] + drafts], device=model.device), pos,
                                            all_logits=True, hidden=True, states=states)
            a, nxt = accept(sampler, drafts, qs, all_logits)
            if a < len(drafts):
                rollback(model, states, a)
        seq = [tok] + drafts
        if prefix is not None:
            prefix.fed(seq[:a + 1], pos)  # the model holds [tok, d1..da] at pos..pos+a
        spec["draft_tokens"] += len(drafts)
        spec["accepted_tokens"] += a
        spec["rounds"] += 1
        before = len(out)
        for j, t in enumerate(drafts[:a] + [nxt]):
            done = emit(t, pos + j + 2)
            if done is not None:
                break
        m_tokens, m_hidden, m_pos = drafts[:a] + [nxt], hid[:a + 1], pos
        pos += a + 1
        tok = nxt
        if len(out) > before:
            decoder.note_token_ms((time.perf_counter() - t0) * 1e3 / (len(out) - before))
    if keep:  # the draft layer over the last positions: it then holds every position the model does, plus one
        model.mtp.forward(model, m_tokens, m_hidden, m_pos)
        prefix.drafted = prefix.live[:m_pos + 1] + m_tokens
    return out, done
