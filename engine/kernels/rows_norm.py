"""The residual add and RMSNorm of T rows in one kernel (the speculative verification's rows, engine.core.
spec_graphs): x' = x + delta and h = RMSNorm(x') * weight, rounded as engine.core.model.rms_norm rounds (Hugging
Face's: x + delta rounded to the dtype, statistics in float32, the normalised row rounded before the weight, or
zero-centred (1 + w) in float32 with one rounding). The torch form is ten kernels a norm; a layer has two.

The arithmetic is the GEMVs' norm prologue (engine.kernels.prologue_jit), one program per row; the kernel is
engine.kernels.rows_norm_jit's.
"""

from __future__ import annotations

import torch

from engine.kernels.interpreter import interpreting


def add_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
             zc: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [..., K] (same shape) -> (x + delta, RMSNorm(x + delta) * weight) in x's dtype, every row of K
    values; ``delta`` None: (x, RMSNorm(x) * weight)."""
    from engine.kernels import rows_norm_jit

    k = x.shape[-1]
    xc = x.contiguous()
    dc = xc if delta is None else delta.contiguous()
    xo, h = (xc if delta is None else torch.empty_like(xc)), torch.empty_like(xc)
    rows_norm_jit.add_norm_kernel[(xc.numel() // k,)](
        xc, dc, weight, xo, h, k, float(eps), EMU=interpreting() and x.dtype == torch.bfloat16, ZC=zc,
        DELTA=delta is not None, BLOCK=min(8192, 1 << (k - 1).bit_length()), num_warps=8 if k >= 4096 else 4)
    return xo, h


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zc: bool = False) -> torch.Tensor:
    """engine.core.model.rms_norm's signature and rounding, in one kernel (rows of x's last dimension)."""
    return add_norm(x, None, weight, eps, zc)[1]
