"""Prefix reuse across requests: a new prompt that starts with what the model last processed prefills only the
rest. A PrefixCache tells what one sequence slot holds (the one-at-a-time runner's slot 0; with
``--max-concurrency N`` > 1 each slot has one of its own, engine/service/rank_batch.py, and ``match`` lets it
compare the free slots before it picks one). Its tensor work reads and writes the model's current slot
(Model.use_slot). One sequence per slot, so:

  - K/V of positions [0, L) are still in the cache when the new prompt shares its first L tokens with the
    sequence the cache last held (``live``): nothing to copy for full attention;
  - a linear-attention layer's state is the state AT one position: it can continue the live sequence from
    its end, or restart from a snapshot (conv ring + recurrent state, copied) taken at an earlier position of
    the same tokens. Snapshots are taken where a prompt's prefill ends (one token before its last, so the same
    prompt sent again has a state to start its last token from) and at chunk boundaries of long prompts,
    within a byte budget, least recently used first out;
  - the MTP draft layer's K/V at position p is computed from the model's hidden state at p and token p + 1,
    so it holds what a cold prefill leaves only for positions whose tokens up to p + 1 are those the draft
    layer last ran over (``drafted``). A request that speculates reuses no more than that: a request that did
    not speculate leaves the draft layer's K/V as it was (wrong for its own new positions), and a sampled
    answer's draws depend on the drafts, so a reused draft layer must be the cold one to give the cold answer.

Both ranks of TP2 see the same requests in the same order and decide the same reuse; the lockstep records
carry each prefill step's position, so a rank that reused a different prefix fails the check on its first
chunk. Everything here is host bookkeeping plus device copies; no shape depends on it.
"""

from __future__ import annotations

import array
import collections
import hashlib

DEFAULT_BUDGET_BYTES = 2 << 30
SNAPSHOT_EVERY = 8192  # positions between snapshots inside a long prompt (at chunk boundaries)


def _keys(tokens: list[int], positions) -> dict[int, str]:
    """The key of ``tokens[:p]`` for each p of ``positions``, in one pass (one running SHA-256 over the ids as
    int64: a follow-up on a 100K-token conversation checks a dozen snapshots; hashing each prefix from its
    start, as text, took 0.12 s of its time to first token)."""
    h, last, out = hashlib.sha256(), 0, {}
    for p in sorted(positions):
        h.update(array.array("q", tokens[last:p]).tobytes())
        last = p
        out[p] = h.copy().hexdigest()
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, model, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        self.model = model
        self.budget = budget_bytes
        self.live: list[int] = []  # tokens whose K/V (and states) the model holds, in position order
        # tokens the MTP draft layer's K/V was computed for: positions [0, len - 1) hold a cold prefill's
        self.drafted: list[int] = []
        self.snaps: collections.OrderedDict[int, tuple[str, list]] = collections.OrderedDict()  # pos -> (key, copies)
        self.linear = [la for la in model.layers if la.kind == "linear_attention"]
        self.hits = 0
        self.reused_tokens = 0

    # ---- what the model holds ----------------------------------------------------------------------
    def forget(self) -> None:
        """The cache holds nothing reusable (e.g. after warm-up steps that wrote position 0)."""
        self.live = []
        self.drafted = []
        self.snaps.clear()

    def fed(self, tokens: list[int], start: int) -> None:
        """Tokens now processed at positions start.. (prefill chunks and decode steps)."""
        del self.live[start:]
        self.live.extend(tokens)

    def _state_bytes(self) -> int:
        return sum(la.conv_ring.numel() * la.conv_ring.element_size() + la.rec_state.numel() * 4
                   for la in self.linear)

    def snapshot(self, pos: int) -> None:
        """Copy the linear-attention states at position ``pos`` (== len(live)); nothing for dense models."""
        if not self.linear or pos != len(self.live) or pos in self.snaps:
            return
        size = self._state_bytes()
        if size > self.budget:
            return
        while self.snaps and (len(self.snaps) + 1) * size > self.budget:
            self.snaps.popitem(last=False)
        copies = [t.clone() for la in self.linear for t in (la.conv_ring, la.rec_state)]
        self.snaps[pos] = (_keys(self.live, (pos,))[pos], copies)

    # ---- a new request -------------------------------------------------------------------------------
    def plan(self, prompt: list[int], drafting: bool = False) -> int:
        """Positions of ``prompt`` whose state can be reused (0: prefill all), and the model set up to continue
        from there: at least the last prompt token is always prefilled (its logits start decoding). ``drafting``:
        the request speculates with the MTP draft layer, whose K/V at the reused positions must be valid too."""
        n = self._reusable(prompt, drafting)
        if drafting:  # the draft layer's positions [0, n) serve this prompt; it rewrites those after them
            self.drafted = list(prompt[:n + 1])
        if n:
            self.hits += 1
            self.reused_tokens += n
        return n

    def match(self, prompt: list[int], drafting: bool = False) -> int:
        """What plan() would reuse of ``prompt``, changing nothing (the batch loop, engine/service/rank_batch.py,
        asks each free slot's cache before it picks one)."""
        return self._reusable(prompt, drafting, apply=False)

    def _reusable(self, prompt: list[int], drafting: bool, apply: bool = True) -> int:
        n = min(common_prefix(prompt, self.live), len(prompt) - 1)
        if drafting:  # the prefill writes the draft layer from position n on: it must hold [0, n) already
            n = min(n, common_prefix(prompt, self.drafted) - 1)
        if n <= 0:
            return 0
        if self.linear:
            if n == len(self.live):
                pass  # the live states are at exactly n
            else:
                keys = _keys(prompt, [p for p in self.snaps if p <= n])
                usable = [p for p, key in keys.items() if self.snaps[p][0] == key]
                if not usable:
                    return 0
                n = max(usable)
                if apply:
                    self.snaps.move_to_end(n)
                    it = iter(self.snaps[n][1])
                    for la in self.linear:
                        la.conv_ring.copy_(next(it))
                        la.rec_state.copy_(next(it))
        if apply:
            del self.live[n:]
            # snapshots past n belong to a sequence the new prompt is about to overwrite
            for p in [p for p in self.snaps if p > n]:
                del self.snaps[p]
        return n
