"""The residual add and RMSNorm of T rows in one kernel (engine.kernels.rows_norm launches it): the arithmetic of the
GEMVs' norm prologue (engine.kernels.prologue_jit), one program per row."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.prologue_jit import norm_stats
from engine.kernels.rounding_jit import normed, rnd


@triton.jit
def add_norm_kernel(x_ptr, d_ptr, w_ptr, xo_ptr, h_ptr, K, eps, EMU: tl.constexpr, ZC: tl.constexpr,
                    DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    dt = h_ptr.dtype.element_ty
    off = row * K
    xr = x_ptr + off
    dr = d_ptr + off
    cols = tl.arange(0, BLOCK)
    if DELTA:
        rstd = norm_stats(xr, dr, xo_ptr + off, K, 0, eps, dt, EMU, BLOCK)  # writes the row's x + delta
    else:  # the norm alone (q / k heads): the statistics of x in the same order
        ss = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            xv = tl.load(xr + k0 + cols, mask=(k0 + cols) < K, other=0.0).to(tl.float32)
            ss += xv * xv
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    for k0 in range(0, K, BLOCK):
        m = (k0 + cols) < K
        r = tl.load(xr + k0 + cols, mask=m, other=0.0).to(tl.float32)
        if DELTA:  # x + delta again: no read of what other lanes stored
            r = rnd(r + tl.load(dr + k0 + cols, mask=m, other=0.0).to(tl.float32), dt, EMU).to(tl.float32)
        nw = tl.load(w_ptr + k0 + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(h_ptr + off + k0 + cols, normed(r, rstd, nw, dt, EMU, ZC), mask=m)
