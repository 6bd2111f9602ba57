"""The TP2 allreduce of the decode step's layers without a kernel of its own (kernel choice ``fused`` on the
GPU-side mailbox, ``device_mailbox_graph``).

A layer's two partial outputs (o_proj's and down's, each rank's share of the heads / MLP columns) meet in the
GEMVs around them instead of in an allreduce kernel between them:

  send     the producing GEMV (o_proj, SiLU + down: engine.kernels.decode) writes its output rows as usual and, in
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

Modes (engine.core.decode_mode.EXCHANGES, chosen once per decoder into its DecodeMode): "send" sends from the GEMVs
and receives in a small kernel (the default); "norm-receive" receives in the next GEMV too (slower on the H200: its
programs wait behind program 0; V100PLAN_ENGINE_EXCHANGE=gemv, its earlier name, still selects it); "kernel" is
the graph mailbox's allreduce kernel.

The buffers, tickets and kernels live in engine.kernels.exchange, which engine.kernels.decode imports as well: neither
this module nor the GEMV imports the other.
"""

from __future__ import annotations

from engine.kernels.exchange import MAX_EXCHANGES, EpilogueExchange, Sent, Ticket

__all__ = ["MAX_EXCHANGES", "EpilogueExchange", "Sent", "Ticket"]
