"""A Triton GEMV for the decode step's one-row products (y [1, N] = x [1, K] @ W [N, K]^T + b).

At M = 1 cuBLAS reads the narrow matrices (QKV, o_proj, down: N or K of 4096) through split-K plus a
separate reduce kernel, at 2700-3350 GB/s on an H200 against 4089 GB/s for the wide gate/up product
(docs/engine-speed.md, profile of 2026-11-30). This kernel gives each program a few whole rows and
walks K in 16-byte vector loads, one kernel per product, no split and no reduce: every product is as
wide as its N rows, and the sum over K stays in float32 and in a fixed order (deterministic, the same
on every rank). It is the prologue kernel below with no prologue (PROLOGUE_PLAIN).

Only where engine.core.decode_mode.kernel_choice picks Triton kernels (compute capability 8.0+, and the V100 in fp16
with an sm_70 ptxas: engine.core.sm70); never on CPU, which keeps F.linear. The block sizes per (N, K) come from the card family's tuning table
(engine.tuning: ``gemv``, ``prologue``, ``fp16_silu``; bench: ``python -m engine.bench.gemv --write-table``), with a
default for shapes it does not list.
"""

from __future__ import annotations

import enum
import functools

import torch
import torch.nn.functional as F

from engine import tuning
from engine.kernels import exchange, rounding
from engine.kernels.exchange import as_sent as _sent  # noqa: F401  (the names engine.kernels.gemv_int4 reads from here)
from engine.kernels.exchange import epw as _epw
from engine.kernels.exchange import exchange_finish  # noqa: F401
from engine.kernels.exchange import ticket_args as _xs_args
from engine.kernels.rounding import interpreting


# The same GEMV with its input made in the prologue (kernel choice "fused", engine.core.attention): each
# program computes the input row itself from rows in L2 instead of a separate kernel writing it.
#   PROLOGUE_NORM: h = RMSNorm(x + delta) * norm_weight (Hugging Face's rounding: x + delta rounded to the
#                  dtype, statistics in float32, the normalised row rounded before the weight multiply and the
#                  product rounded); program 0 also writes x + delta, the new residual.
#   PROLOGUE_SILU: h = SiLU(gate) * up from the gate/up product's row [gate | up] (each rounded, as eager).
# Block sizes per (N, K): the tuning table's ``prologue`` (bench: python -m engine.bench.gemv --fused), else ``gemv``.
class Prologue(enum.IntEnum):
    """The prologues, by the values the kernels take (PROLOGUE=); inside gemv_prologue_kernel as the constants
    PRO_PLAIN, PRO_NORM and PRO_SILU (Triton reads only constexpr globals)."""
    PLAIN = 0
    NORM = 1
    SILU = 2


# plain ints, as callers pass them (engine.kernels.gemv_int4's kernel compares its PROLOGUE with these values)
PROLOGUE_PLAIN, PROLOGUE_NORM, PROLOGUE_SILU = (int(p) for p in Prologue)
PROLOGUE_NAMES = ("plain", "norm", "silu")


@functools.cache
def _prologue_kernel():
    # Triton resolves triton.language, the functions a kernel calls and its constants through the module's globals
    global tl, rnd, _normed, _residual, _norm_stats, _xs_send
    global PRO_PLAIN, PRO_NORM, PRO_SILU
    import triton
    import triton.language as tl

    rnd, _normed = rounding.kernels()
    _xs_send = exchange.kernels().send  # the receive and finish kernels are exchange's own
    # the prologues inside the kernel: Prologue's values as constants the compiler folds
    PRO_PLAIN, PRO_NORM, PRO_SILU = (tl.constexpr(int(p)) for p in Prologue)

    @triton.jit
    def _residual(x_ptr, d_ptr, xo_ptr, offs, mask, pid, dt: tl.constexpr, EMU: tl.constexpr):
        """x + delta at offs, rounded to the dtype, as float32; program 0 also writes it (the new residual) to xo."""
        xv = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dv = tl.load(d_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r = rnd(xv + dv, dt, EMU)
        if pid == 0:
            tl.store(xo_ptr + offs, r, mask=mask)
        return r.to(tl.float32)

    @triton.jit
    def _norm_stats(x_ptr, d_ptr, xo_ptr, K, pid, eps, dt: tl.constexpr, EMU: tl.constexpr,
                    STATS_BLOCK: tl.constexpr):
        """1/rms of x + delta (rounded to the dtype), float32, in a fixed order over the whole row; program 0
        also writes x + delta (the new residual) to xo."""
        scols = tl.arange(0, STATS_BLOCK)
        ss = tl.zeros((STATS_BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, STATS_BLOCK):
            r = _residual(x_ptr, d_ptr, xo_ptr, k0 + scols, (k0 + scols) < K, pid, dt, EMU)
            ss += r * r
        return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)

    @triton.jit
    def gemv_prologue_kernel(w_ptr, x_ptr, d_ptr, nw_ptr, b_ptr, y_ptr, xo_ptr, N, K, stride_w, eps,
                             xs_peer, xs_ser, xs_slot, xs_e,
                             PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EMU: tl.constexpr,
                             STATS_BLOCK: tl.constexpr, SEND: tl.constexpr = False,
                             EPW: tl.constexpr = 2, ZC: tl.constexpr = False):
        pid = tl.program_id(0)
        dt = x_ptr.dtype.element_ty
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        cols0 = tl.arange(0, BLOCK_K)
        rstd = 0.0
        if PROLOGUE == PRO_NORM:  # statistics of x + delta (rounded), float32, fixed order; the whole row at once
            rstd = _norm_stats(x_ptr, d_ptr, xo_ptr, K, pid, eps, dt, EMU, STATS_BLOCK)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        wp = w_ptr + rows[:, None].to(tl.int64) * stride_w + cols0[None, :]
        for k0 in range(0, K, BLOCK_K):
            cmask = (k0 + cols0) < K
            if EVEN_K:
                w = tl.load(wp + k0, mask=rmask[:, None], other=0.0, eviction_policy="evict_first")
            else:
                w = tl.load(wp + k0, mask=rmask[:, None] & cmask[None, :], other=0.0, eviction_policy="evict_first")
            if PROLOGUE == PRO_NORM:
                xv = tl.load(x_ptr + k0 + cols0, mask=cmask, other=0.0).to(tl.float32)
                dv = tl.load(d_ptr + k0 + cols0, mask=cmask, other=0.0).to(tl.float32)
                nw = tl.load(nw_ptr + k0 + cols0, mask=cmask, other=0.0).to(tl.float32)
                r = rnd(xv + dv, dt, EMU).to(tl.float32)
                h = _normed(r, rstd, nw, dt, EMU, ZC).to(tl.float32)
            elif PROLOGUE == PRO_SILU:
                g = tl.load(x_ptr + k0 + cols0, mask=cmask, other=0.0).to(tl.float32)
                u = tl.load(x_ptr + K + k0 + cols0, mask=cmask, other=0.0).to(tl.float32)
                sg = rnd(g / (1.0 + tl.exp(-g)), dt, EMU).to(tl.float32)
                h = rnd(sg * u, dt, EMU).to(tl.float32)
            else:
                h = tl.load(x_ptr + k0 + cols0, mask=cmask, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * h[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        yd = rnd(y, y_ptr.dtype.element_ty, EMU)
        tl.store(y_ptr + rows, yd, mask=rmask)
        if SEND:  # the same rows, tagged, into the peer's inbox: one 64-bit store per word
            _xs_send(yd, pid, rows, rmask, N, xs_peer, xs_ser, xs_slot, xs_e, BLOCK_N, EPW)

    return gemv_prologue_kernel


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
    peer, ser, slot, e = _xs_args(send, out)
    stats_block = min(8192, 1 << (k - 1).bit_length())
    _prologue_kernel()[(-(-n // bn),)](
        w, x, delta if delta is not None else x, norm_weight if norm_weight is not None else x,
        b if b is not None else w, out, x_out if x_out is not None else out, n, k, w.stride(0), float(eps),
        peer, ser, slot, e,
        PROLOGUE=prologue, HAS_BIAS=b is not None, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        EMU=interpreting() and x.dtype == torch.bfloat16, STATS_BLOCK=stats_block,
        SEND=send is not None, EPW=_epw(out.dtype), ZC=zc,
        num_warps=warps)
    return out


def linear_norm(x: torch.Tensor, delta, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
                b: torch.Tensor | None = None, zc: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + delta) @ w^T + b, x + delta) for one row x, delta [1, 1, K]: one kernel.
    ``zc``: the zero-centred norm (weight applied as 1 + w, Qwen3.5). A packed (GPTQ / AWQ) ``w``:
    engine.kernels.gemv_int4's kernel, the same prologue; packed parts beside dense ones (engine.core.quant.Rows): each
    part's kernel."""
    if hasattr(w, "parts"):
        return w.linear_norm(x, delta, norm_weight, eps, b, zc=zc)
    if not isinstance(w, torch.Tensor):
        from engine.kernels import gemv_int4

        return gemv_int4.linear_norm(x, delta, norm_weight, eps, w, b, zc=zc)
    k = w.shape[1]
    out = torch.empty(w.shape[0], dtype=x.dtype, device=x.device)
    x_out = torch.empty(k, dtype=x.dtype, device=x.device)
    launch_prologue(PROLOGUE_NORM, x.reshape(-1).contiguous(), w, b, out, delta.reshape(-1).contiguous(),
                    norm_weight, eps, x_out, zc=zc)
    return out.view(*x.shape[:-1], w.shape[0]), x_out.view(x.shape)


def linear_silu(gu: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, send=None):
    """(SiLU(gate) * up) @ w^T + b for one row gu [1, 1, 2K] = [gate | up]: one kernel. With ``send`` (a
    Ticket) the rows also go to the peer and the result is an engine.allreduce.epilogue.Sent."""
    if not isinstance(w, torch.Tensor):
        from engine.kernels import gemv_int4

        return gemv_int4.linear_silu(gu, w, b, send)
    out = torch.empty(w.shape[0], dtype=gu.dtype, device=gu.device)
    launch_prologue(PROLOGUE_SILU, gu.reshape(-1).contiguous(), w, b, out, send=send)
    return _sent(out.view(*gu.shape[:-1], w.shape[0]), send)


def linear_send(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, send=None):
    """x [1, 1, K] @ w^T + b (the prologue kernel, plain); with ``send`` (a Ticket) its rows also go to the peer
    and the result is an engine.allreduce.epilogue.Sent."""
    if not isinstance(w, torch.Tensor):
        from engine.kernels import gemv_int4

        return gemv_int4.linear_send(x, w, b, send)
    out = torch.empty(w.shape[0], dtype=x.dtype, device=x.device)
    launch_prologue(PROLOGUE_PLAIN, x.reshape(-1).contiguous(), w, b, out, send=send)
    return _sent(out.view(*x.shape[:-1], w.shape[0]), send)


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
