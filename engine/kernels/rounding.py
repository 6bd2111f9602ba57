"""Rounding as torch and Hugging Face round, for the decode step's Triton kernels (engine.kernels.gemv, the TP2 exchange
in engine.kernels.exchange, engine.core.attention, engine.core.gdn_fused, engine.kernels.gemv_int4).

  rnd      float32 -> the dtype, round to nearest even (by hand for bf16 under the interpreter, EMU).
  _normed  RMSNorm's output from float32 r, its 1/rms and the weight, rounded as Hugging Face rounds it.

Triton resolves the functions a kernel calls through the kernel module's globals: a module whose kernels call these
binds them as its own globals (``rnd, _normed = rounding.kernels()``) before it defines its kernels.
"""

from __future__ import annotations

import functools
import os

# Triton's CPU interpreter (TRITON_INTERPRET=1: the tests), read when this module is first imported, as Triton
# reads it when it is: never during a decode step
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """Triton's CPU interpreter: it rounds float32 -> bf16 by truncation, so the kernels round to nearest-even
    themselves there (ROUND_EMU), as the GPU does."""
    return _INTERPRETING


@functools.cache
def kernels() -> tuple:
    """(rnd, _normed) as Triton device functions."""
    # Triton resolves triton.language and the functions a kernel calls through the module's globals
    global tl, rnd, _normed
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
    def _normed(r, rstd, nw, dt: tl.constexpr, EMU: tl.constexpr, ZC: tl.constexpr):
        """RMSNorm's output from float32 r, its 1/rms and the weight, rounded as Hugging Face rounds it: the
        normalised row rounded before the weight multiply (Llama, Qwen2/3), or zero-centred (Qwen3.5, ZC):
        r * rstd * (1 + w) in float32, rounded once."""
        if ZC:
            return rnd(r * rstd * (1.0 + nw), dt, EMU)
        return rnd(rnd(r * rstd, dt, EMU).to(tl.float32) * nw, dt, EMU)

    return rnd, _normed
