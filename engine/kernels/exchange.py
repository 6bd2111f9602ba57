"""The TP2 exchange inside the decode step's GEMVs, the part shared by the GEMVs that send and receive it
(engine.kernels.decode, engine.kernels.gemv_int4) and the allreduce path that offers it (engine.allreduce.graph_mailbox,
whose protocol engine.allreduce.epilogue describes): one rank's buffers and tickets (EpilogueExchange, Ticket, Sent)
and the launch of the kernel that receives an exchange in a kernel of its own (exchange mode "send") or finishes the
step's last one; the device side (the functions that tag, send and wait for the 8-byte words, and that kernel) is
engine.kernels.exchange_jit. Neither engine.kernels.decode nor engine.allreduce.epilogue imports the other: both
import this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.interpreter import interpreting

MAX_EXCHANGES = 256  # per decode step: 2 per layer


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
        return exchange_finish(sent, x=x, norm_weight=norm_weight, eps=eps, zc=zc)

    def receive(self, sent: "Sent") -> torch.Tensor:
        """The sum of an exchange in a kernel of its own (mode "send"), the serial left as it is."""
        return exchange_finish(sent, bump=False)


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
    arrive under. The receive kernel (EpilogueExchange.receive) or the step's finish sums it; Model.decode_step
    passes it on where an allreduce result would go."""
    part: torch.Tensor
    ticket: Ticket


def ticket_args(ticket, timeout_dummy: torch.Tensor) -> tuple:
    """(peer inbox, serial, slot offset, e) of a ticket, or dummies: what a sending GEMV takes."""
    if ticket is None:
        return timeout_dummy, timeout_dummy, 0, 0
    xs = ticket.xs
    return xs.peer_inbox, xs.serial, ticket.slot * xs.slot_words, ticket.e


def epw(dtype: torch.dtype) -> int:
    """Values per 4-byte data word of the exchange (2 for 16-bit floats, 1 for float32)."""
    return 4 // torch.empty((), dtype=dtype).element_size()


def as_sent(part: torch.Tensor, send: "Ticket | None"):
    """A GEMV's output: ``part`` itself, or with ``send`` (a Ticket) the Sent the next norm GEMV receives."""
    return part if send is None else Sent(part, send)


def exchange_finish(sent, bump: bool = True, x: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                    eps: float = 0.0, zc: bool = False) -> torch.Tensor:
    """This rank's partial + the peer's, in a kernel of its own -> [1, 1, D] in the partial's dtype.
    ``bump``: the step's last exchange (one program waits for the words, then bumps the step serial); else
    the receive of exchange mode "send" (programs of 512 values each). With ``x`` and ``norm_weight`` (bump
    only): RMSNorm(x + the sum) * norm_weight instead of the sum (rows of up to 8192)."""
    part, ticket = sent.part, sent.ticket
    xs = ticket.xs
    own = part.reshape(-1).contiguous()
    out = torch.empty_like(own)
    n = own.numel()
    norm = x is not None
    if norm and (not bump or n > 8192):
        raise ValueError("the final norm is fused into the step's last exchange only, for rows of up to 8192")
    whole = 1 << (n - 1).bit_length()
    block = (whole if norm else min(4096, whole)) if bump else min(512, whole)
    grid = 1 if bump else -(-n // block)
    from engine.kernels import exchange_jit

    exchange_jit.exchange_finish_kernel[(grid,)](
        own, out, xs.inbox, xs.serial, xs.failed, ticket.slot * xs.slot_words, ticket.e, xs.timeout_ns, n,
        BLOCK=block, EPW=epw(own.dtype), EMU=interpreting() and own.dtype == torch.bfloat16, INTERP=interpreting(),
        BUMP=bump, x_ptr=x.reshape(-1).contiguous() if norm else own, nw_ptr=norm_weight if norm else own,
        eps=float(eps), NORM=norm, ZC=zc, num_warps=8 if bump else 4)
    return out.view(part.shape)
