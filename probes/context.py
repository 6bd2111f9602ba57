"""What the cases of one probe run share: options, the cards found, and what each case measured.

Cases write into plain dicts here; probes/assemble.py freezes them into the
report's dataclasses at the end.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# The quick probe's throttle window: at least 4 s, then until power has held steady for 2 s on every card,
# at most 10 s. An H200 under this load reaches its 700 W cap within 1.5 s (tests/fixtures/probes/
# h200-probe-quick.json: 690 W from 1.5 s on, the verdict the same at 4 s as at 15 s).
QUICK_MIN_LOAD_S = 4.0
QUICK_MAX_LOAD_S = 10.0


@dataclasses.dataclass(frozen=True)
class Options:
    mode: str = "standard"  # quick | standard | soak
    load_duration_s: float = 30.0  # the throttle load's longest window
    min_load_s: float | None = None  # stop the load early once power is steady, but not before this; None: never
    sample_hz: float = 10.0
    only: tuple[str, ...] = ()  # case keys; empty = all
    keep_samples: bool = True

    @classmethod
    def for_mode(cls, mode: str, duration_s: float | None = None, only: tuple[str, ...] = ()) -> Options:
        default = {"quick": QUICK_MAX_LOAD_S, "standard": 30.0, "soak": 600.0}[mode]
        # quick mode stops its throttle load once every card's power is steady (a window given by hand runs whole)
        early = QUICK_MIN_LOAD_S if mode == "quick" and not duration_s else None
        return cls(mode=mode, load_duration_s=float(duration_s or default), min_load_s=early, only=only)


def record(values: dict[str, Any], unavailable: dict[str, str], field: str, value: Any,
           reason: str | None = None) -> None:
    """values[field] = value; a None value keeps why in unavailable[field] ("unavailable" when no reason is
    given), a measured one clears an earlier reason."""
    values[field] = value
    if value is None:
        unavailable[field] = reason or "unavailable"
    else:
        unavailable.pop(field, None)


@dataclasses.dataclass
class CardState:
    """One card as the cases learn about it: field -> value, field -> reason when unavailable."""

    index: int
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    unavailable: dict[str, str] = dataclasses.field(default_factory=dict)

    def set(self, field: str, value: Any, reason: str | None = None) -> None:
        record(self.values, self.unavailable, field, value, reason)


@dataclasses.dataclass
class ProbeContext:
    options: Options
    nvml_problem: str | None = None
    cards: list[CardState] = dataclasses.field(default_factory=list)
    host: dict[str, Any] = dataclasses.field(default_factory=dict)
    host_unavailable: dict[str, str] = dataclasses.field(default_factory=dict)
    pairs: dict[tuple[int, int], dict[str, Any]] = dataclasses.field(default_factory=dict)
    method: dict[str, Any] = dataclasses.field(default_factory=dict)

    def pair(self, src: int, dst: int) -> dict[str, Any]:
        return self.pairs.setdefault((src, dst), {"src": src, "dst": dst, "unavailable": {}})

    def set_host(self, field: str, value: Any, reason: str | None = None) -> None:
        record(self.host, self.host_unavailable, field, value, reason)
