"""The engine's one dtype rule, a pure function of the card: bfloat16 where the card has bf16 tensor cores (compute
capability 8.0 and later), float16 on 7.x (the V100: torch may emulate bf16 there, which is not a fact to plan on),
float32 on CPU. Stdlib only and importing nothing of the engine, so the control plane (the planner, deploy) uses the
same rule as `serve`, `generate` and the benches without importing torch.
"""

from __future__ import annotations

CPU = "cpu"
AUTO = "auto"  # what a caller passes to mean "the rule for the card this runs on"
DTYPES = ("float32", "float16", "bfloat16")
BF16_MIN_CC = (8, 0)


def dtype_for(card: tuple[int, int] | str | None) -> str:
    """The dtype for ``card``: a compute capability (major, minor), or "cpu" / None for a CPU."""
    if card is None or card == CPU:
        return "float32"
    if isinstance(card, str) or len(card) != 2:
        raise ValueError(f"a card is a compute capability (major, minor) or 'cpu', not {card!r}")
    return "bfloat16" if tuple(card) >= BF16_MIN_CC else "float16"


def resolve(requested: str | None, card: tuple[int, int] | str | None) -> str:
    """``requested`` where it names a dtype, else (None or "auto") the rule for ``card``."""
    if requested in (None, AUTO):
        return dtype_for(card)
    if requested not in DTYPES:
        raise ValueError(f"dtype {requested!r}: expected one of {', '.join(DTYPES)} or {AUTO}")
    return requested
