"""A rank's continuous-batching loop (``--max-concurrency N`` > 1; docs/service.md, "Concurrent requests").

N sequence slots (Model.setup_cache(context, slots=N)). Each round: both ranks agree which of the requests and
cancels they have received are taken now, admitted requests get a free slot, one prefill chunk of the oldest
admitted prompt runs (the prefill budget between two decode steps), then every running sequence with a
token to decode decodes it together (Model.decode_batch: the torch forms, replayed from CUDA graphs per row bucket
and window with serve --batch-graphs where the decoder runs graphs: engine/service/batch_graphs.py). A finished
or cancelled request frees its slot at once.

Prefix reuse per slot (unless --no-prefix-cache): a freed slot keeps what it held (K/V, Gated DeltaNet states and
their snapshots, the MTP draft layer's K/V), told by an engine.core.prefix.PrefixCache of its own; a new request
goes to the free slot whose cache reuses most of its prompt (else to the free slot that ended longest ago, reset),
which continues from there and prefills only the rest. Nothing is copied between slots.

Agreement: the proxy sends every generate and cancel message to both ranks in one order, so each rank holds
a prefix of the same two sequences; each round both ranks exchange how many of each they hold and take the
shorter prefix of each. Everything after that is deterministic, so both ranks run the identical schedule
(the same rows in the same slots at every step); after every step both exchange a lockstep record of all the
step's tokens (engine.core.lockstep), and a difference ends the pair as for one sequence.
"""

from __future__ import annotations

import contextlib
import queue
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.service import protocol, rank_batch_images, rank_batch_spec


@dataclass(eq=False)  # compared by identity (it holds tensors)
class Seq:
    rid: str
    slot: int
    sampler: object
    prompt_len: int
    max_tokens: int
    stop_ids: set
    pos: int = 0                 # the position the next decoded token is written at
    logits: torch.Tensor | None = None
    pending: int | None = None   # the last token handed out, not yet decoded
    out: list = field(default_factory=list)
    chunks: int = 0              # prefill chunks run
    ids: list = field(default_factory=list)  # the prompt
    filled: int = 0              # prompt positions prefilled so far
    cached: int = 0              # prompt positions reused from the slot's prefix cache (not prefilled)
    bounds: list = field(default_factory=list)  # the prefill chunks' bounds still to run
    spec: object = None          # engine.service.rank_batch_spec.SlotSpec of a speculating sequence
    images: object = None        # engine.service.rank_batch_images.SlotImages while a prompt with images prefills
    delta: int = 0               # its rotary positions run this far from its cache positions after the prompt


class BatchLoop:
    """Runs on the rank's main thread in place of Rank.serve's one-at-a-time loop."""

    def __init__(self, rank, server, n: int):
        self.rank, self.server, self.n = rank, server, n
        self.model = rank.model
        self.arrived: deque[dict] = deque()  # generate messages received and not yet taken, in order
        self.taken = 0                    # how many generate messages both ranks have taken
        self.cancels_taken = 0            # ... and cancels (rank.cancel_log holds those not yet taken)
        self.cancelled: set[str] = set()  # ids whose cancel both ranks have taken
        self.waiting: deque[dict] = deque()
        self.admitted: deque[Seq] = deque()  # admitted, prompt not yet wholly prefilled (oldest first)
        self.running: dict[int, Seq] = {}  # slot -> sequence
        self.step = 0
        from engine.core.prefix import PrefixCache

        prefix = getattr(self.model, "prefix", None)  # the one-at-a-time cache (runner.prepare): its budget, split
        self.stores = None if prefix is None else [PrefixCache(self.model, prefix.budget // n) for _ in range(n)]
        self.ended = [-1] * n  # when each slot's last request ended (a count), to pick the free slot to overwrite
        self.ends = 0
        self.spec_k = getattr(rank, "spec_tokens", 0) or 0  # --speculative mtp: drafts per round (rank_batch_spec)

    # ---- agreement ------------------------------------------------------------------------------------
    def _drain(self, block: bool) -> None:
        try:
            if block:
                self.arrived.append(self.rank.requests.get())
            while True:
                self.arrived.append(self.rank.requests.get_nowait())
        except queue.Empty:
            pass

    def _agree(self) -> None:
        """Take the requests and cancels both ranks hold (the shorter prefix of each sequence)."""
        log = self.rank.cancel_log  # the reader thread appends; only this thread takes from the front
        n_gen, n_cancel = self.taken + len(self.arrived), self.cancels_taken + len(log)
        path = self.rank.path
        if path is not None:
            mine = torch.tensor([n_gen, n_cancel], dtype=torch.int64, device=self.model.device)
            both = [t.to("cpu").tolist() for t in path.all_gather(mine)]
            n_gen, n_cancel = min(b[0] for b in both), min(b[1] for b in both)
        for _ in range(n_gen - self.taken):
            self.waiting.append(self.arrived.popleft())
        self.taken = n_gen
        for _ in range(n_cancel - self.cancels_taken):
            self.cancelled.add(log.pop(0))
        self.cancels_taken = n_cancel
        # a cancel always follows its request on both sockets, so a taken cancel whose request is neither
        # waiting nor running came after that request ended: nothing to keep
        live = {seq.rid for seq in self.running.values()} | {req["id"] for req in self.waiting}
        self.cancelled &= live

    # ---- the loop -------------------------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            self.round()

    def round(self, block: bool = True) -> None:
        """Agree, admit, one prefill chunk, sample, one batched decode step (``block``: wait for a request when
        there is nothing to do; tests drive the loop round by round)."""
        idle = not self.running and len(self.waiting) == 0
        self._drain(block=block and idle and not self.arrived)
        self._agree()
        for seq in list(self.running.values()):
            if seq.rid in self.cancelled:
                self._finish(seq, "cancelled")
        while self.waiting and len(self.running) < self.n:
            self._admit(self.waiting.popleft())
        self.rank.busy = bool(self.running)
        self._prefill_some()
        self._sample()
        self._speculate()
        self._decode()

    def _admit(self, req: dict) -> None:
        from engine.core.logits_processors import Processing
        from engine.core.sampling import Sampler

        rid = req["id"]
        if rid in self.cancelled:
            self._send(protocol.done(rid, "cancelled", len(req["prompt_ids"]), 0))
            return
        try:
            ids = [int(t) for t in req["prompt_ids"]]
            if not ids:
                raise ValueError("the prompt is empty: give at least one token")
            if len(ids) >= self.model.max_context:
                raise ValueError(f"prompt of {len(ids)} tokens does not fit the context of {self.model.max_context}")
            sampler = Sampler(req.get("temperature", 0.0), req.get("top_p", 1.0), req.get("seed", 0),
                              processing=Processing.from_message(req.get("sampling"), ids),
                              constraint=self.rank.constraint_for(req.get("grammar")))
            # a prompt with images runs its key ids (image tokens by content: engine.vision.prompt)
            ids, images = rank_batch_images.begin(getattr(self.rank, "vision", None), req, ids)
        except (ValueError, TypeError, OverflowError) as e:
            self._send(protocol.error(rid, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"))
            return
        # a request with penalties, a bias or a grammar is not speculated (its drafts would be judged without
        # them), nor one with images, as one request at a time does
        drafting = bool(self.spec_k) and sampler.plain and images is None
        slot, first = self._slot_for(ids, drafting)
        seq = Seq(rid, slot, sampler, len(ids), min(int(req["max_tokens"]), self.model.max_context - len(ids)),
                  set(req.get("stop_token_ids") or []), pos=len(ids))
        seq.ids, seq.filled, seq.cached, seq.bounds = ids, first, first, self._bounds(len(ids), first)
        seq.images, seq.delta = images, images.delta if images is not None else 0
        if drafting:
            seq.spec = rank_batch_spec.start(self, seq, ids, first)
        self.running[slot] = seq
        self.admitted.append(seq)

    # ---- prefix reuse per slot ------------------------------------------------------------------------
    @contextlib.contextmanager
    def in_slot(self, slot: int):
        """The model's prefill, its MTP draft layer and the slot's prefix cache work on ``slot`` inside."""
        before = self.model.use_slot(slot)
        try:
            yield
        finally:
            self.model.use_slot(before)

    def store(self, slot: int):
        """The slot's engine.core.prefix.PrefixCache (None: --no-prefix-cache)."""
        return self.stores[slot] if self.stores else None

    def _slot_for(self, ids: list[int], drafting: bool) -> tuple[int, int]:
        """(the free slot for this prompt, the positions it reuses there). The free slot whose prefix cache reuses
        most of the prompt, where that is at least half of what the slot holds (a shared first token or system
        prompt does not throw a stored conversation away while an empty slot is free); else the free slot whose
        request ended longest ago (never used ones first), reusing what it can of that one. ``drafting``: the
        request speculates, so only positions whose MTP draft-layer K/V the slot holds count."""
        free = sorted(set(range(self.n)) - set(self.running))
        if not self.stores:
            slot = min(free, key=lambda s: (self.ended[s], s))
            self.model.reset_slot(slot)
            return slot, 0
        reuse = {s: self.stores[s].match(ids, drafting) for s in free}
        good = [s for s in free if reuse[s] > 0 and 2 * reuse[s] >= len(self.stores[s].live)]
        slot = max(good, key=lambda s: (reuse[s], -s)) if good else min(free, key=lambda s: (self.ended[s], s))
        if reuse[slot] > 0:
            with self.in_slot(slot):
                return slot, self.stores[slot].plan(ids, drafting)  # the linear-attention states from a snapshot
        self.stores[slot].forget()
        self.model.reset_slot(slot)
        return slot, 0

    def _bounds(self, n: int, first: int) -> list[int]:
        """The prompt's prefill chunks from ``first`` (the rank's --prefill-chunk each); with a prefix cache on a
        model with linear attention the last prompt token is a chunk of its own, so the states one token before
        the end are kept (the same prompt again reuses all but that token), as the one-at-a-time runner does."""
        out = list(range(first, n, self.rank.prefill_chunk())) + [n]
        if self.stores and self.stores[0].linear and n - 1 > first and n - 1 not in out:
            out.insert(-1, n - 1)
        return out

    def _prefill_some(self) -> None:
        """The prefill budget between two decode steps: one chunk (the rank's --prefill-chunk) of the prompt
        admitted first, so running streams wait at most one chunk per step. A prompt's last chunk gives its
        first logits; a request that fails there is answered with an error and frees its slot."""
        from engine.allreduce.base import PathError
        from engine.core.lockstep import LockstepFailure

        if not self.admitted:
            return
        seq = self.admitted[0]
        try:
            self._prefill_chunk(seq)
        except (LockstepFailure, PathError):
            raise  # a fault of the rank pair: the proxy restarts both
        except Exception as e:  # noqa: BLE001 - both ranks fail the same way on the same input; the pair stays up
            self._fail(seq, e)
            return
        if seq.filled == len(seq.ids):
            self.admitted.popleft()
            if seq.max_tokens <= 0:
                self._finish(seq, "length")

    def _prefill_chunk(self, seq: Seq) -> None:
        """The next chunk of the prompt into the sequence's slot (a progress message after it)."""
        from engine.core.prefix import SNAPSHOT_EVERY

        start, end = seq.bounds[0], seq.bounds[1]
        del seq.bounds[0]
        piece = seq.ids[start:end]
        with self.in_slot(seq.slot), rank_batch_images.prefilling(self.model, self.rank.vision, seq.images):
            logits = self.model.forward(torch.tensor([piece], device=self.model.device), start,
                                        hidden=seq.spec is not None)
            if seq.spec is not None:  # the MTP draft layer's K/V over the chunk (its slot's)
                logits, hidden = logits
                seq.spec.prefill.chunk(start, hidden)
            store = self.store(seq.slot)
            if store is not None:
                store.fed(piece, start)
                if end == len(seq.ids) - 1 or (end < len(seq.ids) and end // SNAPSHOT_EVERY > start // SNAPSHOT_EVERY):
                    store.snapshot(end)
        seq.filled = end
        if end == len(seq.ids):
            seq.logits = logits
            seq.images = None  # its rows and spans are no longer read (the delta stays)
            if seq.spec is not None:
                seq.spec.prefilled(end)
        self.rank.counter += 1
        seq.chunks += 1
        self._send(protocol.progress(seq.rid, end, self.rank.counter))

    def _sample(self) -> None:
        """Each sequence with fresh logits draws its token (its own sampler); then they go out (_hand_out)."""
        drawn = []
        for slot in sorted(self.running):
            seq = self.running[slot]
            if seq.logits is None:
                continue
            tok = seq.sampler(seq.logits)
            seq.logits = None
            drawn.append((seq, [tok]))
        self._hand_out(drawn)

    def _speculate(self) -> None:
        """One speculative round for each speculating sequence with a token to run, slot after slot
        (rank_batch_spec); their tokens then go out together. A round that fails fails its request alone."""
        from engine.allreduce.base import PathError
        from engine.core.lockstep import LockstepFailure

        if not self.spec_k:
            return
        given = []
        for slot in sorted(self.running):
            seq = self.running[slot]
            if seq.spec is None or seq.pending is None:
                continue
            try:
                given.append((seq, rank_batch_spec.run(self, seq)))
            except (LockstepFailure, PathError):
                raise
            except Exception as e:  # noqa: BLE001 - both ranks fail the same way on the same input
                self._fail(seq, e)
        self._hand_out(given)

    def _hand_out(self, given: list) -> None:
        """(sequence, its new tokens) pairs: one lockstep record over all of them (slot, token, the samplers' RNG
        offsets, positions) before any is sent, then each sequence's tokens up to a stop or its length."""
        from engine.core.lockstep import Record, token_hash
        from engine.vision import serve as vserve

        if not given:
            return
        self.rank.counter += 1
        towers = vserve.lockstep_hash(getattr(self.rank, "vision", None))  # the towers' outputs since the last step
        if self.rank.lockstep is not None:
            flat = [v for seq, toks in given for t in toks for v in (seq.slot, t)]
            h = token_hash(flat, sum(seq.sampler.offset for seq, _ in given)) ^ int(self.rank.step_faults(self.step))
            self.rank.lockstep.exchange(Record(self.step, len(flat) // 2, h ^ towers, sum(s.pos for s, _ in given), 0))
        self.step += 1
        for seq, toks in given:
            for tok in toks:
                k = len(seq.out)
                seq.out.append(tok)
                self._send(protocol.token(seq.rid, k, tok, self.rank.counter, seq.sampler.logprobs))
                if tok in seq.stop_ids:
                    self._finish(seq, "stop")
                    break
                if len(seq.out) >= seq.max_tokens:
                    self._finish(seq, "length")
                    break
            else:
                seq.pending = toks[-1]

    def _decode(self) -> None:
        rows = [self.running[s] for s in sorted(self.running)
                if self.running[s].pending is not None and self.running[s].spec is None]
        if not rows:
            return
        graphs = getattr(self.rank, "batch_graphs", None)
        if graphs is not None:  # captured per (row bucket, window): engine/service/batch_graphs.py
            logits = graphs.step([s.pending for s in rows], [s.pos for s in rows], [s.slot for s in rows],
                                 [s.pos + s.delta for s in rows])
        else:
            dev = self.model.device
            toks = torch.tensor([s.pending for s in rows], dtype=torch.int64, device=dev)
            pos = torch.tensor([s.pos for s in rows], dtype=torch.int64, device=dev)
            slots = torch.tensor([s.slot for s in rows], dtype=torch.int64, device=dev)
            rope = None
            if any(s.delta for s in rows):  # a prompt with images: its positions after the prompt turn at pos + delta
                rope = torch.tensor([s.pos + s.delta for s in rows], dtype=torch.int64, device=dev)
            logits = self.model.decode_batch(toks, pos, slots, max(s.pos for s in rows) + 1, rope)
        for i, seq in enumerate(rows):
            if self.stores:
                self.stores[seq.slot].fed([seq.pending], seq.pos)
            seq.logits, seq.pending = logits[i], None
            seq.pos += 1

    def _finish(self, seq: Seq, reason: str) -> None:
        del self.running[seq.slot]
        if seq in self.admitted:  # cancelled while its prompt was being prefilled
            self.admitted.remove(seq)
        # the slot is free at once; with a prefix cache it keeps what it holds for a request that reuses it
        if not self.stores:
            self.model.reset_slot(seq.slot)
        elif seq.spec is not None:
            try:
                rank_batch_spec.catch_up(self, seq)
            except Exception:  # noqa: BLE001 - what the draft layer holds is in doubt: nothing kept
                self._drop(seq.slot)
        self.ended[seq.slot], self.ends = self.ends, self.ends + 1
        self.cancelled.discard(seq.rid)
        from engine.core.lockstep import token_hash

        # the one-at-a-time loop's line (the acceptance suite compares the two ranks' lines), and the slot
        self.rank.log_line(f"request {seq.rid} finish={reason} steps={seq.chunks + len(seq.out)} "
                           f"tokens={len(seq.out)} hash={token_hash(seq.out, 0):016x} slot={seq.slot}")
        decode = None
        if seq.spec is not None:  # this request's drafted and accepted tokens (/metrics), with the rank's figures
            decode = {**self.rank.decode_stats(), "spec": dict(seq.spec.counts)}
        self._send(protocol.done(seq.rid, reason, seq.prompt_len, len(seq.out), decode=decode,
                                 cached_tokens=seq.cached))

    def _fail(self, seq: Seq, e: Exception) -> None:
        """A request that failed in its slot: an error for it, the slot freed and zeroed."""
        del self.running[seq.slot]
        if seq in self.admitted:
            self.admitted.remove(seq)
        self._drop(seq.slot)
        self.ended[seq.slot], self.ends = self.ends, self.ends + 1
        self.cancelled.discard(seq.rid)
        self.rank.log_line(f"request {seq.rid} failed: {e}")
        self._send(protocol.error(seq.rid, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"))

    def _drop(self, slot: int) -> None:
        """A slot whose state is in doubt (a request failed in it): nothing kept, zeroed."""
        if self.stores:
            self.stores[slot].forget()
        self.model.reset_slot(slot)

    def _send(self, msg: dict) -> None:
        self.server.send(msg)

