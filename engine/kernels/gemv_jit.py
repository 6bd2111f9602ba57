"""The decode step's one-row GEMV in Triton (engine.kernels.decode launches it): y [N] = W [N, K] @ h [K] (+ b), each
program BLOCK_N whole rows, K walked in 16-byte vector loads, the sum in float32 in a fixed order; h made from x by
the prologue (engine.kernels.prologue: plain, norm, SiLU); SEND: the rows also go, tagged, into the TP2 peer's inbox."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.exchange_jit import xs_send
from engine.kernels.prologue_jit import PRO_NORM, PRO_SILU, norm_stats
from engine.kernels.rounding_jit import normed, rnd


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
        rstd = norm_stats(x_ptr, d_ptr, xo_ptr, K, pid, eps, dt, EMU, STATS_BLOCK)
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
            h = normed(r, rstd, nw, dt, EMU, ZC).to(tl.float32)
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
        xs_send(yd, pid, rows, rmask, N, xs_peer, xs_ser, xs_slot, xs_e, BLOCK_N, EPW)

