"""Parsing of the quantities users type: token counts with K = 1024."""

from __future__ import annotations

import re

from v100plan.errors import BadInput

_TOKENS = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")
_HINT = "write a whole number of tokens, optionally with K (x1024) or M: 8192, 186K, 256K"


def parse_tokens(text: str | int) -> int:
    """'186000' -> 186000, '186K' / '186k' -> 190464, '256K' -> 262144, '1M' -> 1048576.

    K = 1024 and M = 1024 * 1024 tokens, as context lengths are quoted.
    """
    if isinstance(text, int):
        value = text
    else:
        m = _TOKENS.match(str(text))
        if not m:
            raise BadInput(
                f"cannot read {text!r} as a token count",
                hint=_HINT,
            )
        number, suffix = float(m.group(1)), m.group(2).lower()
        value = number * {"": 1, "k": 1024, "m": 1024 * 1024}[suffix]
        if value != int(value):
            raise BadInput(f"{text!r} is not a whole number of tokens", hint=_HINT)
        value = int(value)
    if value <= 0:
        raise BadInput(f"a token count must be positive, got {text!r}", hint=_HINT)
    return value


def format_tokens(n: int) -> str:
    """262144 -> '256K', 190464 -> '186K', 1000 -> '1000'."""
    return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)


GB_PER_GIB = 2**30 / 1e9  # 1.0737: the planner counts decimal GB; cards are sold and shown by nvidia-smi in GiB


def gib(gb: float) -> float:
    """Decimal GB -> GiB, how a card's memory is quoted (an H200's 150.75 GB is its "141 GB", 140.4 GiB)."""
    return gb / GB_PER_GIB
