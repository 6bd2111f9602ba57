"""Rounding as torch and Hugging Face round, as Triton device functions the decode step's kernels call (the GEMVs,
the TP2 exchange, the attention, the Gated DeltaNet kernels, the int4 GEMV):

  rnd      float32 -> the dtype, round to nearest even (by hand for bf16 under the interpreter, EMU).
  normed   RMSNorm's output from float32 r, its 1/rms and the weight, rounded as Hugging Face rounds it.

A kernel module imports them by name: Triton resolves the functions a kernel calls through its module's globals.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rnd(x, dt: tl.constexpr, EMU: tl.constexpr):
    """float32 -> dt, round to nearest even (EMU: by hand for bf16, for the interpreter)."""
    if EMU:
        b = x.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        x = ((b >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dt)


@triton.jit
def normed(r, rstd, nw, dt: tl.constexpr, EMU: tl.constexpr, ZC: tl.constexpr):
    """RMSNorm's output from float32 r, its 1/rms and the weight, rounded as Hugging Face rounds it: the
    normalised row rounded before the weight multiply (Llama, Qwen2/3), or zero-centred (Qwen3.5, ZC):
    r * rstd * (1 + w) in float32, rounded once."""
    if ZC:
        return rnd(r * rstd * (1.0 + nw), dt, EMU)
    return rnd(rnd(r * rstd, dt, EMU).to(tl.float32) * nw, dt, EMU)
