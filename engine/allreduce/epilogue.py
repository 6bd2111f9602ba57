"""The TP2 allreduce of the decode step's layers without a kernel of its own (kernel choice ``fused`` on the
GPU-side mailbox, ``device_mailbox_graph``).

A layer's two partial outputs (o_proj's and down's, each rank's share of the heads / MLP columns) meet in the
GEMVs around them instead of in an allreduce kernel between them:

  send     the producing GEMV (o_proj, SiLU + down: engine.core.gemv) writes its output rows as usual and, in
           its epilogue, the same values tagged into the peer's inbox: 8-byte words (tag << 32 | 4 data
           bytes), one 64-bit store each, so a reader that sees the tag sees that word's data (no fence, no
           flag), as the graph mailbox's words.
  receive  the next GEMV's norm prologue (norm + gate/up, norm + QKV of the next layer): its program 0 waits
           until every word of the peer's row carries this exchange's tag (volatile loads, bounded by a
           %globaltimer deadline like the graph mailbox's waits), adds its own partial and the peer's in float32
           and rounds to the dtype (bit for bit torch's ``a + b`` and the mailbox's allreduce, both ranks the
           same sum), writes the new residual and the normalised row, and raises a ready flag (release); the
           kernel's other programs wait for the flag (acquire) and read the row from L2. Rows of up to 8192.
  finish   the step's last exchange (the last layer's down) is received by a one-program kernel that writes
           the sum for the final norm and bumps the step serial.

Tags: ((serial mod 2^22) + 1) << 8 | e for the step's e-th exchange (e < 256: 128 layers), never 0 (the inbox
starts zeroed) and never equal to what an earlier exchange left in the slot. Two slots alternate by e's
parity: the peer's exchange e + 2 cannot be written before this rank has produced e + 1, which it does only
after it consumed e (the mailboxes' argument). The serial lives in device memory and is bumped by the finish
kernel, so graph replays use the next step's tags without the host; both ranks run the same steps, so their
serials agree. A wait that passes its deadline sets the path's ``failed`` flag (the host's check after the
step turns it into an error, as for the mailbox's own waits) and the step runs on with garbage that never
reaches a client.

Modes (MODES, DEFAULT): "send" sends from the GEMVs and receives in a small kernel; "gemv" receives in the next GEMV too
(slower on the H200: its programs wait behind program 0); "kernel" is the graph mailbox's allreduce kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ENV = "V100PLAN_ENGINE_EXCHANGE"
MODES = {
    "kernel": "an allreduce kernel between the GEMVs (the graph mailbox's: send, wait, add in one kernel)",
    "gemv": ("inside the GEMVs: o_proj / down send their rows to the peer in their epilogue, the next norm "
             "GEMV's program 0 waits for and adds them, the others read its row"),
    "send": ("o_proj / down send their rows to the peer in their epilogue; a small kernel waits for and adds "
             "them before the next norm GEMV"),
}
# The measured choice (2 x H200, Qwen3-8B shape, bf16, 1K context, one bench-tp2 run, 2026-12-01,
# tests/fixtures/multigpu/h200x2-exchange-modes-2026-12-01.json; docs/engine-speed.md): the TP2 step took
# 2.742 ms with "send", 2.843 ms with "kernel" and 3.028 ms with "gemv".
DEFAULT = "send"
MAX_EXCHANGES = 256  # per decode step: 2 per layer


def requested() -> str:
    """The exchange mode: V100PLAN_ENGINE_EXCHANGE, else DEFAULT."""
    v = os.environ.get(ENV) or DEFAULT
    if v not in MODES:
        raise ValueError(f"{ENV}={v!r}: expected one of {', '.join(MODES)}")
    return v


class EpilogueExchange:
    """One rank's side: its inbox (where the peer writes), the peer's inbox (where it writes), the step
    serial and the failed flag it shares with its path. Tensors may be CPU tensors in the tests (Triton's
    interpreter, the two ranks in two threads)."""

    def __init__(self, *, inbox: torch.Tensor, peer_inbox: torch.Tensor, rank: int, timeout_ns: int,
                 failed: torch.Tensor, serial: torch.Tensor | None = None):
        # inbox / peer_inbox: int64 [2, slot_words] (two slots of 8-byte words)
        if inbox.dtype != torch.int64 or inbox.dim() != 2 or inbox.shape[0] != 2:
            raise ValueError("the epilogue inbox is int64 [2, words]")
        self.inbox, self.peer_inbox = inbox, peer_inbox
        self.rank, self.timeout_ns, self.failed = rank, int(timeout_ns), failed
        self.serial = serial if serial is not None else torch.zeros(1, dtype=torch.int32, device=inbox.device)
        # the receiving GEMV's program 0 raises this (tag << 32) once the summed row is written
        self.ready = torch.zeros(1, dtype=torch.int64, device=inbox.device)
        self.slot_words = inbox.shape[1]

    def words_for(self, n: int, dtype: torch.dtype) -> int:
        per = 4 // torch.empty((), dtype=dtype).element_size()
        if per not in (1, 2) or n % per:
            raise ValueError(f"cannot exchange {n} values of {dtype} in 4-byte words")
        return n // per

    def ticket(self, e: int, n: int, dtype: torch.dtype) -> "Ticket":
        if not 0 <= e < MAX_EXCHANGES:
            raise ValueError(f"exchange {e} of a step: at most {MAX_EXCHANGES} (128 layers)")
        if self.words_for(n, dtype) > self.slot_words:
            raise ValueError(f"a row of {n} values exceeds the epilogue inbox's {self.slot_words} words")
        return Ticket(self, e)

    def finish(self, sent: "Sent", x: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
               eps: float = 0.0, zc: bool = False) -> torch.Tensor:
        """The sum of the step's last exchange (waits for the peer's words), and the serial bumped; with ``x``
        and ``norm_weight``: RMSNorm(x + the sum) * norm_weight (the model's final norm) instead."""
        from engine.core import gemv

        return gemv.exchange_finish(sent, x=x, norm_weight=norm_weight, eps=eps, zc=zc)

    def receive(self, sent: "Sent") -> torch.Tensor:
        """The sum of an exchange in a kernel of its own (mode "send"), the serial left as it is."""
        from engine.core import gemv

        return gemv.exchange_finish(sent, bump=False)


@dataclass(frozen=True)
class Ticket:
    """Exchange ``e`` of this step through ``xs``: what a producing GEMV needs to send its rows."""
    xs: EpilogueExchange
    e: int

    @property
    def slot(self) -> int:
        return self.e & 1


@dataclass(frozen=True)
class Sent:
    """A partial output that was sent: this rank's rows (``part``, [1, 1, D]) and the ticket the peer's
    arrive under. The next norm GEMV receives it (engine.core.gemv.linear_norm); Model.decode_step passes it
    on where an allreduce result would go."""
    part: torch.Tensor
    ticket: Ticket


def describe(mode: str | None = None) -> str:
    return MODES[mode or requested()]
