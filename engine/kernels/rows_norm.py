"""The residual add and RMSNorm of T rows in one kernel (the speculative verification's rows, engine.core.
spec_graphs): x' = x + delta and h = RMSNorm(x') * weight, rounded as engine.core.model.rms_norm rounds (Hugging
Face's: x + delta rounded to the dtype, statistics in float32, the normalised row rounded before the weight, or
zero-centred (1 + w) in float32 with one rounding). The torch form is ten kernels a norm; a layer has two.

The arithmetic is engine.kernels.gemv's norm prologue (its ``_norm_stats`` and ``_normed``), one program per row.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    global tl, rnd, _normed, _norm_stats
    import triton
    import triton.language as tl

    from engine.kernels import gemv

    gemv._prologue_kernel()
    rnd, _normed, _norm_stats = gemv.rnd, gemv._normed, gemv._norm_stats

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
            rstd = _norm_stats(xr, dr, xo_ptr + off, K, 0, eps, dt, EMU, BLOCK)  # writes the row's x + delta
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
            tl.store(h_ptr + off + k0 + cols, _normed(r, rstd, nw, dt, EMU, ZC), mask=m)

    return add_norm_kernel


def add_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
             zc: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [..., K] (same shape) -> (x + delta, RMSNorm(x + delta) * weight) in x's dtype, every row of K
    values; ``delta`` None: (x, RMSNorm(x) * weight)."""
    from engine.kernels.gemv import interpreting

    k = x.shape[-1]
    xc = x.contiguous()
    dc = xc if delta is None else delta.contiguous()
    xo, h = (xc if delta is None else torch.empty_like(xc)), torch.empty_like(xc)
    _kernel()[(xc.numel() // k,)](xc, dc, weight, xo, h, k, float(eps),
                                  EMU=interpreting() and x.dtype == torch.bfloat16, ZC=zc, DELTA=delta is not None,
                                  BLOCK=min(8192, 1 << (k - 1).bit_length()), num_warps=8 if k >= 4096 else 4)
    return xo, h


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zc: bool = False) -> torch.Tensor:
    """engine.core.model.rms_norm's signature and rounding, in one kernel (rows of x's last dimension)."""
    return add_norm(x, None, weight, eps, zc)[1]
