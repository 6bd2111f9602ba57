"""The prologues' device side, shared by the GEMVs that run them (engine.kernels.gemv_jit, engine.kernels.gemv_int4_jit)
and the rows' norm (engine.kernels.rows_norm_jit): Prologue's values as constants the compiler folds, the residual
add and the RMSNorm statistics, rounded as Hugging Face rounds them (engine.kernels.prologue says what each
prologue computes)."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.prologue import Prologue
from engine.kernels.rounding_jit import rnd

# Prologue's values as constants the compiler folds (a kernel compares its PROLOGUE with these)
PRO_PLAIN, PRO_NORM, PRO_SILU = (tl.constexpr(int(p)) for p in Prologue)


@triton.jit
def residual(x_ptr, d_ptr, xo_ptr, offs, mask, pid, dt: tl.constexpr, EMU: tl.constexpr):
    """x + delta at offs, rounded to the dtype, as float32; program 0 also writes it (the new residual) to xo."""
    xv = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dv = tl.load(d_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = rnd(xv + dv, dt, EMU)
    if pid == 0:
        tl.store(xo_ptr + offs, r, mask=mask)
    return r.to(tl.float32)


@triton.jit
def norm_stats(x_ptr, d_ptr, xo_ptr, K, pid, eps, dt: tl.constexpr, EMU: tl.constexpr, STATS_BLOCK: tl.constexpr):
    """1/rms of x + delta (rounded to the dtype), float32, in a fixed order over the whole row; program 0 also
    writes x + delta (the new residual) to xo."""
    scols = tl.arange(0, STATS_BLOCK)
    ss = tl.zeros((STATS_BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, STATS_BLOCK):
        r = residual(x_ptr, d_ptr, xo_ptr, k0 + scols, (k0 + scols) < K, pid, dt, EMU)
        ss += r * r
    return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
