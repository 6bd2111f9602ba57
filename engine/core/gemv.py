"""A Triton GEMV for the decode step's one-row products (y [1, N] = x [1, K] @ W [N, K]^T + b).

At M = 1 cuBLAS reads the narrow matrices (QKV, o_proj, down: N or K of 4096) through split-K plus a
separate reduce kernel, at 2700-3350 GB/s on an H200 against 4089 GB/s for the wide gate/up product
(docs/engine-speed.md, profile of 2026-11-30). This kernel gives each program a few whole rows and
walks K in 16-byte vector loads, one kernel per product, no split and no reduce: every product is as
wide as its N rows, and the sum over K stays in float32 and in a fixed order (deterministic, the same
on every rank). Exposed as the torch op ``v100plan::gemv`` so torch.compile'd blocks keep it as one
opaque call and fuse around it.

Only where engine.core.decode_mode.kernel_choice picks Triton kernels (compute capability 8.0+, and the V100 in fp16
with an sm_70 ptxas: engine.core.sm70); never on CPU, which keeps F.linear. The block sizes per (N, K) come from the measured table
BLOCKS (bench: ``python -m engine.bench.gemv``), with a default for shapes it does not list.
"""

from __future__ import annotations

import enum
import functools
import json
import os

import torch
import torch.nn.functional as F

from engine.core import exchange, rounding
from engine.core.exchange import as_sent as _sent  # noqa: F401  (the names engine.core.gemv_int4 reads from here)
from engine.core.exchange import epw as _epw
from engine.core.exchange import exchange_finish  # noqa: F401
from engine.core.exchange import ticket_args as _xs_args
from engine.core.rounding import interpreting

# (N, K) -> (BLOCK_N rows per program, BLOCK_K columns per iteration, num_warps): the fastest of CONFIGS
# per shape of the 8B models at TP1 and TP2, measured on an H200 on 2026-11-30
# (tests/fixtures/engine/h200-gemv-2026-11-30.json, judged by tests/engine/test_engine_gemv_recording.py).
DEFAULT_BLOCKS = (2, 1024, 4)  # the most frequent winner there
BLOCKS: dict[tuple[int, int], tuple[int, int, int]] = {
    (6144, 4096): (8, 512, 4),
    (4096, 4096): (2, 1024, 4),
    (24576, 4096): (2, 1024, 4),
    (4096, 12288): (2, 1024, 4),
    (3072, 4096): (8, 1024, 8),
    (4096, 2048): (4, 512, 4),
    (12288, 4096): (2, 1024, 4),
    (4096, 6144): (4, 512, 4),
    (28672, 4096): (2, 1024, 4),
    (4096, 14336): (2, 1024, 4),
}
BLOCKS_ENV = "V100PLAN_ENGINE_GEMV_BLOCKS"  # a JSON file {"NxK": [BLOCK_N, BLOCK_K, num_warps]} (the bench's "best")
CONFIGS = [(2, 1024, 4), (4, 512, 4), (4, 1024, 4), (8, 512, 4), (8, 256, 4), (4, 1024, 8), (8, 1024, 8),
           (16, 512, 8), (2, 2048, 8), (1, 2048, 4)]


def _load_blocks() -> None:
    path = os.environ.get(BLOCKS_ENV)
    if path:
        with open(path) as fh:
            raw = json.load(fh)
        raw = raw.get("best", raw)
        BLOCKS.update({tuple(int(v) for v in key.split("x")): tuple(int(v) for v in val) for key, val in raw.items()})


_load_blocks()



@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(w_ptr, x_ptr, b_ptr, y_ptr, N, K, stride_w, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        cols0 = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        wp = w_ptr + rows[:, None].to(tl.int64) * stride_w + cols0[None, :]
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(wp + k0, mask=rmask[:, None], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptr + k0 + cols0)
            else:
                cmask = (k0 + cols0) < K
                w = tl.load(wp + k0, mask=rmask[:, None] & cmask[None, :], other=0.0,
                            eviction_policy="evict_first")
                x = tl.load(x_ptr + k0 + cols0, mask=cmask, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)

    return gemv_kernel


# The same GEMV with its input made in the prologue (kernel choice "fused", engine.core.attention): each
# program computes the input row itself from rows in L2 instead of a separate kernel writing it.
#   PROLOGUE_NORM: h = RMSNorm(x + delta) * norm_weight (Hugging Face's rounding: x + delta rounded to the
#                  dtype, statistics in float32, the normalised row rounded before the weight multiply and the
#                  product rounded); program 0 also writes x + delta, the new residual.
#   PROLOGUE_SILU: h = SiLU(gate) * up from the gate/up product's row [gate | up] (each rounded, as eager).
#   PROLOGUE_NORM_ONE_PASS: the same norm in one pass over K: the sum of squares beside the product, the row's
#                  1/rms applied to each output's float32 sum (no rounding of the normalised row: closer to float32
#                  than Hugging Face's rounding, not equal to it); used where NORM_ONE_PASS says so. On the H200 it
#                  was the slower of the two (2026-11-30: 107 vs 100 us over the four norm products): off.
# Block sizes per (N, K): PROLOGUE_BLOCKS (bench: python -m engine.bench.gemv --fused), else BLOCKS.
class Prologue(enum.IntEnum):
    """The prologues, by the values the kernels take (PROLOGUE=); inside gemv_prologue_kernel as the constants
    PRO_PLAIN, PRO_NORM, PRO_SILU and PRO_NORM1 (Triton reads only constexpr globals)."""
    PLAIN = 0
    NORM = 1
    SILU = 2
    NORM_ONE_PASS = 3


# plain ints, as callers pass them (engine.core.gemv_int4's kernel compares its PROLOGUE with these values)
PROLOGUE_PLAIN, PROLOGUE_NORM, PROLOGUE_SILU, PROLOGUE_NORM_ONE_PASS = (int(p) for p in Prologue)
PROLOGUE_NAMES = ("plain", "norm", "silu", "norm1")
NORM_ONE_PASS = False
# (prologue, N, K) -> blocks: the fastest of engine.bench.gemv.FUSED_CONFIGS per Qwen3-8B shape at TP1 and TP2,
# measured on an H200 on 2026-11-30 (tests/fixtures/engine/h200-fused-2026-11-30.json, its "fused_best";
# judged by tests/engine/test_engine_fused_recording.py)
PROLOGUE_BLOCKS: dict[tuple[str, int, int], tuple[int, int, int]] = {
    ("norm", 6144, 4096): (8, 512, 4),
    ("norm1", 6144, 4096): (4, 512, 4),
    ("norm", 24576, 4096): (32, 256, 8),
    ("norm1", 24576, 4096): (8, 512, 4),
    ("silu", 4096, 12288): (8, 512, 4),
    ("norm", 3072, 4096): (8, 1024, 8),
    ("norm1", 3072, 4096): (4, 512, 4),
    ("norm", 12288, 4096): (32, 256, 8),
    ("norm1", 12288, 4096): (4, 512, 4),
    ("silu", 4096, 6144): (8, 512, 4),
}
# a JSON file {"norm:NxK": [BLOCK_N, BLOCK_K, num_warps], ..., "attention": [...], "norm_one_pass": bool}
# (python -m engine.bench.gemv --fused writes one: its "fused_best")
FUSED_ENV = "V100PLAN_ENGINE_FUSED_BLOCKS"
# engine.core.attention's (positions per tile, num_warps, programs per kv head or 0 = its splits_for); None = its own
ATTENTION_CONFIG: tuple[int, int, int] | None = None


def _load_fused() -> None:
    global NORM_ONE_PASS, ATTENTION_CONFIG
    path = os.environ.get(FUSED_ENV)
    if not path:
        return
    with open(path) as fh:
        raw = json.load(fh)
    raw = raw.get("fused_best", raw)
    for key, val in raw.items():
        if ":" in key:
            name, shape = key.split(":")
            n, k = (int(v) for v in shape.split("x"))
            PROLOGUE_BLOCKS[(name, n, k)] = tuple(int(v) for v in val)
    if "norm_one_pass" in raw:
        NORM_ONE_PASS = bool(raw["norm_one_pass"])
    if raw.get("attention"):
        ATTENTION_CONFIG = tuple(raw["attention"])


_load_fused()


@functools.cache
def _prologue_kernel():
    # Triton resolves triton.language, the functions a kernel calls and its constants through the module's globals
    global tl, rnd, _normed, _residual, _norm_stats, _xs_tag, _xs_wait, _xs_values, _xs_send
    global PRO_PLAIN, PRO_NORM, PRO_SILU, PRO_NORM1
    import triton
    import triton.language as tl

    rnd, _normed = rounding.kernels()
    _xs_tag, _xs_send, _xs_wait, _xs_values, _ = exchange.kernels()  # the finish kernel is exchange's own
    # the prologues inside the kernel: Prologue's values as constants the compiler folds
    PRO_PLAIN, PRO_NORM, PRO_SILU, PRO_NORM1 = (tl.constexpr(int(p)) for p in Prologue)

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
                             xs_peer, xs_inbox, xs_ser, xs_failed, xs_slot, xs_e, xs_timeout, xs_ready, h_ptr,
                             PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EMU: tl.constexpr,
                             STATS_BLOCK: tl.constexpr, SEND: tl.constexpr = False, RECV: tl.constexpr = False,
                             EPW: tl.constexpr = 2, INTERP: tl.constexpr = False, ZC: tl.constexpr = False):
        pid = tl.program_id(0)
        dt = x_ptr.dtype.element_ty
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        cols0 = tl.arange(0, BLOCK_K)
        rstd = 0.0
        if RECV:
            # Program 0 alone receives: it waits for the peer's words, makes x + delta (the new residual) and the
            # normalised row h (Hugging Face's rounding), writes both and raises the ready flag; the others wait
            # for the flag and read h from L2. Every program reading the peer's words and re-making the row
            # itself read ~4x the bytes of a plain norm prologue from L2 (H200, 2026-12-01: 4.8 us per exchange
            # slower than the allreduce kernel).
            tag = _xs_tag(xs_ser, xs_e)
            if pid == 0:
                scols = tl.arange(0, STATS_BLOCK)
                smask = scols < K
                xv = tl.load(x_ptr + scols, mask=smask, other=0.0).to(tl.float32)
                dv = tl.load(d_ptr + scols, mask=smask, other=0.0).to(tl.float32)
                pw = _xs_wait(xs_inbox + xs_slot + scols // EPW, smask, tag, xs_failed, xs_timeout, INTERP)
                dv = rnd(dv + _xs_values(pw, scols, EPW, dt), dt, EMU).to(tl.float32)
                r = rnd(xv + dv, dt, EMU)
                tl.store(xo_ptr + scols, r, mask=smask)
                rf = r.to(tl.float32)
                rs = 1.0 / tl.sqrt(tl.sum(rf * rf, axis=0) / K + eps)
                nwv = tl.load(nw_ptr + scols, mask=smask, other=0.0).to(tl.float32)
                tl.store(h_ptr + scols, _normed(rf, rs, nwv, dt, EMU, ZC), mask=smask)
                tl.debug_barrier()
                tl.atomic_xchg(xs_ready, tag << 32, sem="release", scope="gpu")
            fo = tl.arange(0, 2)
            _xs_wait(xs_ready + fo, fo < 1, tag, xs_failed, xs_timeout, INTERP)
            tl.atomic_add(xs_ready, 0, sem="acquire", scope="gpu")
        elif PROLOGUE == PRO_NORM:  # statistics of x + delta (rounded), float32, fixed order; the whole row at once
            rstd = _norm_stats(x_ptr, d_ptr, xo_ptr, K, pid, eps, dt, EMU, STATS_BLOCK)
        if PROLOGUE == PRO_NORM1:
            ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        wp = w_ptr + rows[:, None].to(tl.int64) * stride_w + cols0[None, :]
        for k0 in range(0, K, BLOCK_K):
            cmask = (k0 + cols0) < K
            if EVEN_K:
                w = tl.load(wp + k0, mask=rmask[:, None], other=0.0, eviction_policy="evict_first")
            else:
                w = tl.load(wp + k0, mask=rmask[:, None] & cmask[None, :], other=0.0, eviction_policy="evict_first")
            if RECV:  # program 0's row, from L2 (not a stale L1 line)
                h = tl.load(h_ptr + k0 + cols0, mask=cmask, other=0.0, cache_modifier=".cg").to(tl.float32)
            elif PROLOGUE == PRO_NORM:
                xv = tl.load(x_ptr + k0 + cols0, mask=cmask, other=0.0).to(tl.float32)
                dv = tl.load(d_ptr + k0 + cols0, mask=cmask, other=0.0).to(tl.float32)
                nw = tl.load(nw_ptr + k0 + cols0, mask=cmask, other=0.0).to(tl.float32)
                r = rnd(xv + dv, dt, EMU).to(tl.float32)
                h = _normed(r, rstd, nw, dt, EMU, ZC).to(tl.float32)
            elif PROLOGUE == PRO_NORM1:  # one pass: sum of squares beside the product, rstd applied to the sums
                r = _residual(x_ptr, d_ptr, xo_ptr, k0 + cols0, cmask, pid, dt, EMU)
                nw = tl.load(nw_ptr + k0 + cols0, mask=cmask, other=0.0).to(tl.float32)
                ss += r * r
                h = r * (1.0 + nw) if ZC else r * nw
            elif PROLOGUE == PRO_SILU:
                g = tl.load(x_ptr + k0 + cols0, mask=cmask, other=0.0).to(tl.float32)
                u = tl.load(x_ptr + K + k0 + cols0, mask=cmask, other=0.0).to(tl.float32)
                sg = rnd(g / (1.0 + tl.exp(-g)), dt, EMU).to(tl.float32)
                h = rnd(sg * u, dt, EMU).to(tl.float32)
            else:
                h = tl.load(x_ptr + k0 + cols0, mask=cmask, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * h[None, :]
        y = tl.sum(acc, axis=1)
        if PROLOGUE == PRO_NORM1:
            y = y * (1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps))
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        yd = rnd(y, y_ptr.dtype.element_ty, EMU)
        tl.store(y_ptr + rows, yd, mask=rmask)
        if SEND:  # the same rows, tagged, into the peer's inbox: one 64-bit store per word
            _xs_send(yd, pid, rows, rmask, N, xs_peer, xs_ser, xs_slot, xs_e, BLOCK_N, EPW)

    return gemv_prologue_kernel


def _prologue_default(name: str, n: int) -> tuple[int, int, int]:
    """Blocks for a shape PROLOGUE_BLOCKS does not list (e.g. Llama-3.1-8B's gate/up and down): the recorded
    winners of the same prologue at a similar N (not measured on those shapes themselves)."""
    if name == "norm":
        return (32, 256, 8) if n >= 8192 else (8, 512, 4)
    if name in ("silu", "norm1"):
        return (8, 512, 4) if name == "silu" else (4, 512, 4)
    return DEFAULT_BLOCKS


# SiLU + down in fp16 (the V100's dtype): (8, 512, 4), the bf16 winner, ran 14-18 % slower in fp16 than in bf16 on
# every down shape measured; (4, 512, 4) runs fp16 within 1-2 % of bf16's best (H200, 2026-12-04,
# tests/fixtures/engine/h200-fp16-silu-blocks-2026-12-04.json, judged by tests/engine/test_engine_fp16_silu_recording.py)
FP16_SILU_BLOCKS = (4, 512, 4)


def prologue_blocks(name: str, n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """The blocks launch_prologue takes for a prologue product of n x k in ``dtype`` when none are given."""
    if name == "silu" and dtype == torch.float16:
        return FP16_SILU_BLOCKS
    return PROLOGUE_BLOCKS.get((name, n, k)) or _prologue_default(name, n)


def launch_prologue(prologue: int, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
                    delta: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                    x_out: torch.Tensor | None = None, blocks: tuple[int, int, int] | None = None,
                    send=None, recv=None, zc: bool = False) -> torch.Tensor:
    """out [N] = w [N, K] @ h (+ b), h made from x by the prologue (x: [K]; [2K] = [gate | up] for SiLU);
    PROLOGUE_NORM writes x + delta into x_out [K].
    ``send`` (engine.allreduce.epilogue.Ticket): out's rows also go, tagged, into the peer's inbox.
    ``recv`` (a Ticket, PROLOGUE_NORM only): delta is this rank's partial; the peer's arrives under the ticket."""
    n, k = w.shape
    name = PROLOGUE_NAMES[prologue]
    if prologue == PROLOGUE_PLAIN:
        bn, bk, warps = blocks or BLOCKS.get((n, k), DEFAULT_BLOCKS)
    else:
        bn, bk, warps = blocks or prologue_blocks(name, n, k, x.dtype)
    if interpreting() and blocks is None:
        bn = 32  # the interpreter runs programs one after another: fewer, wider ones
    if recv is not None and prologue != PROLOGUE_NORM:
        raise ValueError("the exchange is received by the two-pass norm prologue only")
    if send is not None and recv is not None and send.xs is not recv.xs:
        raise ValueError("send and receive through different exchanges")
    ticket = send if send is not None else recv
    peer, inbox, ser, failed, slot, e, timeout, ready = _xs_args(ticket, out)
    stats_block = min(8192, 1 << (k - 1).bit_length())
    h_row = out
    if recv is not None:
        if k > stats_block:
            raise ValueError(f"the exchange inside the GEMVs takes rows of up to 8192 values, not {k}")
        h_row = torch.empty(k, dtype=x.dtype, device=x.device)  # program 0's normalised row
    _prologue_kernel()[(-(-n // bn),)](
        w, x, delta if delta is not None else x, norm_weight if norm_weight is not None else x,
        b if b is not None else w, out, x_out if x_out is not None else out, n, k, w.stride(0), float(eps),
        peer, inbox, ser, failed, slot, e, timeout, ready, h_row,
        PROLOGUE=prologue, HAS_BIAS=b is not None, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        EMU=interpreting() and x.dtype == torch.bfloat16, STATS_BLOCK=stats_block,
        SEND=send is not None, RECV=recv is not None, EPW=_epw(out.dtype), INTERP=interpreting(), ZC=zc,
        num_warps=warps)
    return out


def linear_norm(x: torch.Tensor, delta, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
                b: torch.Tensor | None = None, one_pass: bool | None = None,
                zc: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + delta) @ w^T + b, x + delta) for one row x, delta [1, 1, K]: one kernel.
    ``delta`` may be an engine.allreduce.epilogue.Sent (this rank's partial, sent): the kernel waits for the
    peer's and adds them (two-pass norm). ``one_pass``: PROLOGUE_NORM_ONE_PASS instead (default NORM_ONE_PASS).
    ``zc``: the zero-centred norm (weight applied as 1 + w, Qwen3.5). A packed (GPTQ / AWQ) ``w``:
    engine.core.gemv_int4's kernel, the same prologue; packed parts beside dense ones (engine.core.quant.Rows): each
    part's kernel."""
    if hasattr(w, "parts"):
        return w.linear_norm(x, delta, norm_weight, eps, b, zc=zc)
    if not isinstance(w, torch.Tensor):
        from engine.core import gemv_int4

        return gemv_int4.linear_norm(x, delta, norm_weight, eps, w, b, zc=zc)
    k = w.shape[1]
    out = torch.empty(w.shape[0], dtype=x.dtype, device=x.device)
    x_out = torch.empty(k, dtype=x.dtype, device=x.device)
    recv = None
    if not isinstance(delta, torch.Tensor):  # a Sent
        recv, delta = delta.ticket, delta.part
        one_pass = False
    one = NORM_ONE_PASS if one_pass is None else one_pass
    launch_prologue(PROLOGUE_NORM_ONE_PASS if one else PROLOGUE_NORM, x.reshape(-1).contiguous(), w, b, out,
                    delta.reshape(-1).contiguous(), norm_weight, eps, x_out, recv=recv, zc=zc)
    return out.view(*x.shape[:-1], w.shape[0]), x_out.view(x.shape)


def linear_silu(gu: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, send=None):
    """(SiLU(gate) * up) @ w^T + b for one row gu [1, 1, 2K] = [gate | up]: one kernel. With ``send`` (a
    Ticket) the rows also go to the peer and the result is an engine.allreduce.epilogue.Sent."""
    if not isinstance(w, torch.Tensor):
        from engine.core import gemv_int4

        return gemv_int4.linear_silu(gu, w, b, send)
    out = torch.empty(w.shape[0], dtype=gu.dtype, device=gu.device)
    launch_prologue(PROLOGUE_SILU, gu.reshape(-1).contiguous(), w, b, out, send=send)
    return _sent(out.view(*gu.shape[:-1], w.shape[0]), send)


def linear_send(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, send=None):
    """x [1, 1, K] @ w^T + b (the prologue kernel, plain); with ``send`` (a Ticket) its rows also go to the peer
    and the result is an engine.allreduce.epilogue.Sent."""
    if not isinstance(w, torch.Tensor):
        from engine.core import gemv_int4

        return gemv_int4.linear_send(x, w, b, send)
    out = torch.empty(w.shape[0], dtype=x.dtype, device=x.device)
    launch_prologue(PROLOGUE_PLAIN, x.reshape(-1).contiguous(), w, b, out, send=send)
    return _sent(out.view(*x.shape[:-1], w.shape[0]), send)


def launch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
           blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """out [N] = w [N, K] @ x [K] (+ b): the raw launch (x, w contiguous; out preallocated)."""
    n, k = w.shape
    bn, bk, warps = blocks or BLOCKS.get((n, k), DEFAULT_BLOCKS)
    _kernel()[(-(-n // bn),)](w, x, b if b is not None else w, out, n, k, w.stride(0), HAS_BIAS=b is not None,
                              BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0, num_warps=warps)
    return out


@torch.library.custom_op("v100plan::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(w.shape[0], dtype=x.dtype, device=x.device)
    return launch(x.reshape(-1).contiguous(), w, b, out)


@gemv_op.register_fake
def _(x, w, b):
    return torch.empty(w.shape[0], dtype=x.dtype, device=x.device)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for the decode step: the Triton GEMV when x is one row on a CUDA device, else F.linear (a packed
    weight: its own products, engine.core.quant.PackedLinear.linear)."""
    if not isinstance(w, torch.Tensor):
        return w.linear(x, b)
    if x.device.type != "cuda" or x.numel() != w.shape[1]:
        return F.linear(x, w, b)
    return gemv_op(x, w, b).view(*x.shape[:-1], w.shape[0])
