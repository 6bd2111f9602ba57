"""The planner's output: one StrategyResult per strategy and the Plan around them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class StrategyResult:
    name: str
    fits: bool
    gpus_used: int
    max_context: int
    decode_tok_s: float | None
    aggregate_tok_s: float | None
    decode_ceiling_tok_s: float | None
    aggregate_ceiling_tok_s: float | None
    round_ms: float | None
    prefill_s: float | None
    memory_per_gpu_gb: float
    allreduce_path: str
    reason: str
    breakdown: dict[str, Any] = field(default_factory=dict)  # the arithmetic behind the numbers
    # How to start this strategy (plan._launch: engine settings and argv lines; None: it does not fit).
    launch: dict[str, Any] | None = None
    # p10-p90 of what a measurement may give (uncertainty.py), where a bands document was handed to the planner.
    decode_tok_s_interval: list[float] | None = None
    aggregate_tok_s_interval: list[float] | None = None
    prefill_s_interval: list[float] | None = None
    ttft_s: float | None = None                       # time to first token: prefill + one decode round
    ttft_s_interval: list[float] | None = None
    interval_source: str | None = None


@dataclass(frozen=True)
class Plan:
    inputs: dict[str, Any]
    strategies: tuple[StrategyResult, ...]
    recommended: str | None
    why: tuple[str, ...]
    notes: tuple[str, ...]
    launch: dict[str, Any] | None
    nearest_fit: dict[str, Any] | None = None
    # Where the speeds' efficiencies come from (calibration.Speeds.record): the engine, generation and format asked
    # for, whether that combination is calibrated, and what stood in where it is not.
    speeds: dict[str, Any] | None = None

    def strategy(self, name: str) -> StrategyResult:
        return next(s for s in self.strategies if s.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "recommended": self.recommended,
            "strategies": [asdict(s) for s in self.strategies],
            "why": list(self.why),
            "notes": list(self.notes),
            "launch": self.launch,
            "nearest_fit": self.nearest_fit,
            "speeds": self.speeds,
        }
