"""Whether the kernels run in Triton's CPU interpreter (the tests: TRITON_INTERPRET=1 before Triton is imported).

Triton decides it when a kernel is defined (``triton.jit`` returns an InterpretedFunction then), so the launchers
ask a kernel, never the environment: nothing is read at import, nor during a decode step. Imports no Triton until
asked (a CPU-only path never asks).
"""

from __future__ import annotations

import functools


@functools.cache
def interpreting() -> bool:
    """Triton's CPU interpreter: it rounds float32 -> bf16 by truncation and multiplies 16-bit tiles as raw
    integers, so the kernels round to nearest-even by hand there (EMU) and take float32 products (DOT_F32)."""
    from triton.runtime.interpreter import InterpretedFunction

    from engine.kernels import rounding_jit

    return isinstance(rounding_jit.rnd, InterpretedFunction)
