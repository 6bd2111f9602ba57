"""A Triton GEMV for the decode step's one-row products (y [1, N] = x [1, K] @ W [N, K]^T + b).

At M = 1 cuBLAS reads the narrow matrices (QKV, o_proj, down: N or K of 4096) through split-K plus a
separate reduce kernel, at 2700-3350 GB/s on an H200 against 4089 GB/s for the wide gate/up product
(docs/engine-speed.md, profile of 2026-11-30). This kernel gives each program a few whole rows and
walks K in 16-byte vector loads, one kernel per product, no split and no reduce: every product is as
wide as its N rows, and the sum over K stays in float32 and in a fixed order (deterministic, the same
on every rank). It is the prologue kernel below with no prologue (PROLOGUE_PLAIN).

Only where engine.core.decode_mode.kernel_choice picks Triton kernels (compute capability 8.0+, and the V100 in fp16
with an sm_70 ptxas: engine.core.sm70); never on CPU, which keeps F.linear. The kernel is engine.kernels.gemv_jit's.
The block sizes per (N, K) come from the card family's tuning table (engine.tuning: ``gemv``, ``prologue``, ``fp16_silu``; bench: ``python -m engine.bench.gemv --write-table``), with a
default for shapes it does not list.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import tuning
from engine.kernels.exchange import as_sent, epw, ticket_args
from engine.kernels.interpreter import interpreting
from engine.kernels.prologue import PROLOGUE_NAMES, PROLOGUE_NORM, PROLOGUE_PLAIN, PROLOGUE_SILU

# The same GEMV with its input made in the prologue (kernel choice "fused", engine.kernels.attention): each program
# computes the input row itself from rows in L2 instead of a separate kernel writing it (engine.kernels.prologue).
# Block sizes per (N, K): the tuning table's ``prologue`` (bench: python -m engine.bench.gemv --fused), else ``gemv``.


def _prologue_default(name: str, n: int, table) -> tuple[int, int, int]:
    """Blocks for a shape the table's ``prologue`` does not list (e.g. Llama-3.1-8B's gate/up and down): the recorded
    winners of the same prologue at a similar N (not measured on those shapes themselves)."""
    if name == "norm":
        return (32, 256, 8) if n >= 8192 else (8, 512, 4)
    if name == "silu":
        return 8, 512, 4
    return table.gemv_default


# SiLU + down in fp16 (the V100's dtype) takes the table's ``fp16_silu``: (8, 512, 4), the bf16 winner, ran 14-18 %
# slower in fp16 than in bf16 on every down shape measured; (4, 512, 4) runs fp16 within 1-2 % of bf16's best (H200,
# 2026-12-04, tests/fixtures/engine/h200-fp16-silu-blocks-2026-12-04.json)


def prologue_blocks(name: str, n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """The blocks launch_prologue takes for a prologue product of n x k in ``dtype`` when none are given."""
    table = tuning.active()
    if name == "silu" and dtype == torch.float16:
        return table.fp16_silu
    return table.prologue.get((name, n, k)) or _prologue_default(name, n, table)


def launch_prologue(prologue: int, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
                    delta: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                    x_out: torch.Tensor | None = None, blocks: tuple[int, int, int] | None = None,
                    send=None, zc: bool = False) -> torch.Tensor:
    """out [N] = w [N, K] @ h (+ b), h made from x by the prologue (x: [K]; [2K] = [gate | up] for SiLU);
    PROLOGUE_NORM writes x + delta into x_out [K].
    ``send`` (engine.allreduce.epilogue.Ticket): out's rows also go, tagged, into the peer's inbox."""
    n, k = w.shape
    name = PROLOGUE_NAMES[prologue]
    if prologue == PROLOGUE_PLAIN:
        table = tuning.active()
        bn, bk, warps = blocks or table.gemv.get((n, k), table.gemv_default)
    else:
        bn, bk, warps = blocks or prologue_blocks(name, n, k, x.dtype)
    if interpreting() and blocks is None:
        bn = 32  # the interpreter runs programs one after another: fewer, wider ones
    peer, ser, slot, e = ticket_args(send, out)
    stats_block = min(8192, 1 << (k - 1).bit_length())
    from engine.kernels import gemv_jit

    gemv_jit.gemv_prologue_kernel[(-(-n // bn),)](
        w, x, delta if delta is not None else x, norm_weight if norm_weight is not None else x,
        b if b is not None else w, out, x_out if x_out is not None else out, n, k, w.stride(0), float(eps),
        peer, ser, slot, e,
        PROLOGUE=prologue, HAS_BIAS=b is not None, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        EMU=interpreting() and x.dtype == torch.bfloat16, STATS_BLOCK=stats_block,
        SEND=send is not None, EPW=epw(out.dtype), ZC=zc,
        num_warps=warps)
    return out


def linear_norm(x: torch.Tensor, delta, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
                b: torch.Tensor | None = None, zc: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + delta) @ w^T + b, x + delta) for one row x, delta [1, 1, K]: one kernel.
    ``zc``: the zero-centred norm (weight applied as 1 + w, Qwen3.5). A packed (GPTQ / AWQ) ``w`` runs its own
    (engine.core.quant's PackedLinear.linear_norm: engine.kernels.gemv_int4's kernel, the same prologue; a Rows of
    packed parts beside dense ones: each part's kernel)."""
    if not isinstance(w, torch.Tensor):
        return w.linear_norm(x, delta, norm_weight, eps, b, zc=zc)
    k = w.shape[1]
    out = torch.empty(w.shape[0], dtype=x.dtype, device=x.device)
    x_out = torch.empty(k, dtype=x.dtype, device=x.device)
    launch_prologue(PROLOGUE_NORM, x.reshape(-1).contiguous(), w, b, out, delta.reshape(-1).contiguous(),
                    norm_weight, eps, x_out, zc=zc)
    return out.view(*x.shape[:-1], w.shape[0]), x_out.view(x.shape)


def linear_silu(gu: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, send=None):
    """(SiLU(gate) * up) @ w^T + b for one row gu [1, 1, 2K] = [gate | up]: one kernel. With ``send`` (a
    Ticket) the rows also go to the peer and the result is an engine.allreduce.epilogue.Sent. A packed ``w`` runs its
    own (PackedLinear.linear_silu)."""
    if not isinstance(w, torch.Tensor):
        return w.linear_silu(gu, b, send)
    out = torch.empty(w.shape[0], dtype=gu.dtype, device=gu.device)
    launch_prologue(PROLOGUE_SILU, gu.reshape(-1).contiguous(), w, b, out, send=send)
    return as_sent(out.view(*gu.shape[:-1], w.shape[0]), send)


def linear_send(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, send=None):
    """x [1, 1, K] @ w^T + b (the prologue kernel, plain); with ``send`` (a Ticket) its rows also go to the peer
    and the result is an engine.allreduce.epilogue.Sent. A packed ``w`` runs its own (PackedLinear.linear_send)."""
    if not isinstance(w, torch.Tensor):
        return w.linear_send(x, b, send)
    out = torch.empty(w.shape[0], dtype=x.dtype, device=x.device)
    launch_prologue(PROLOGUE_PLAIN, x.reshape(-1).contiguous(), w, b, out, send=send)
    return as_sent(out.view(*x.shape[:-1], w.shape[0]), send)


def launch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
           blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """out [N] = w [N, K] @ x [K] (+ b): the plain GEMV's raw launch (x, w contiguous; out preallocated)."""
    return launch_prologue(PROLOGUE_PLAIN, x, w, b, out, blocks=blocks)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for the decode step: the Triton GEMV when x is one row on a CUDA device, else F.linear (a packed
    weight: its own products, engine.core.quant.PackedLinear.linear)."""
    if not isinstance(w, torch.Tensor):
        return w.linear(x, b)
    if x.device.type != "cuda" or x.numel() != w.shape[1]:
        return F.linear(x, w, b)
    out = torch.empty(w.shape[0], dtype=x.dtype, device=x.device)
    return launch(x.reshape(-1).contiguous(), w, b, out).view(*x.shape[:-1], w.shape[0])
