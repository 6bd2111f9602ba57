"""The prologues a GEMV can run on its input row before the product (engine.kernels.decode, engine.kernels.gemv_int4),
by the values their kernels take (PROLOGUE=); the kernels' device side is engine.kernels.prologue_jit.

  NORM:  h = RMSNorm(x + delta) * norm_weight (Hugging Face's rounding: x + delta rounded to the dtype, statistics in
         float32, the normalised row rounded before the weight multiply and the product rounded); program 0 also
         writes x + delta, the new residual.
  SILU:  h = SiLU(gate) * up from the gate/up product's row [gate | up] (each rounded, as eager).
  PLAIN: h = x.
"""

from __future__ import annotations

import enum


class Prologue(enum.IntEnum):
    """The prologues, by the values the kernels take (PROLOGUE=); inside the kernels as the constants PRO_PLAIN,
    PRO_NORM and PRO_SILU of engine.kernels.prologue_jit (Triton reads only constexpr globals)."""
    PLAIN = 0
    NORM = 1
    SILU = 2


# plain ints, as callers pass them
PROLOGUE_PLAIN, PROLOGUE_NORM, PROLOGUE_SILU = (int(p) for p in Prologue)
PROLOGUE_NAMES = ("plain", "norm", "silu")
