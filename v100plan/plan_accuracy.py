"""The planner against published batch-1 decode figures (profiles/published/decode-batch1.json).

Each point names an engine, a card, a strategy, a model (catalogue id or config.json), a weight
format and a context; the planner predicts its decode tok/s and its ceiling. Points marked
'calibration' set an engine profile's efficiencies (the profile's 'calibration' list says how);
'held_out' points never did, so only they measure prediction:

  error = predicted / published - 1;   median and worst |error| over the held-out points.
Every published figure must also sit under the planner's ceiling (100 % bandwidth, no overhead).

Where a hardware profile's allreduce figures for a path come from a range (its box 'ranges'), the
tables hold the value used; ``range_end`` ('low' or 'high') plans with the range's end instead, so the
sensitivity of the held-out errors to that choice can be printed next to them.
"""

from __future__ import annotations

import copy
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import profiles

PUBLISHED = Path(profiles.__file__).resolve().parent / "published" / "decode-batch1.json"
# The held-out targets: median |error| and the worst any point may miss by.
GOAL_MEDIAN, GOAL_WORST = 0.05, 0.15


@dataclass(frozen=True)
class Row:
    id: str
    role: str
    engine: str
    hardware: str
    gpus: int
    strategy: str
    model: str
    weights: str | None
    context_tokens: int
    published_tok_s: float
    predicted_tok_s: float | None
    ceiling_tok_s: float | None
    source: str
    figure: str
    notes: tuple[str, ...]
    # The plan's line saying which calibration stood in (calibration.stand_in_line); None: calibrated for this
    # engine, card generation and format.
    speeds_stand_in: str | None = None
    stand_in: dict[str, Any] | None = None          # the plan's speeds.stand_in record (its kind is the rung)
    interval: list[float] | None = None             # the strategy's decode_tok_s_interval (with a bands document)

    @property
    def covered(self) -> bool | None:
        """Whether the published figure lies inside the predicted p10-p90 interval (None: no interval)."""
        if self.interval is None:
            return None
        return self.interval[0] <= self.published_tok_s <= self.interval[1]

    @property
    def error(self) -> float | None:
        if self.predicted_tok_s is None:
            return None
        return self.predicted_tok_s / self.published_tok_s - 1.0

    @property
    def under_ceiling(self) -> bool | None:
        return None if self.ceiling_tok_s is None else self.published_tok_s <= self.ceiling_tok_s


def load_points(path: Path = PUBLISHED) -> dict[str, Any]:
    return json.loads(path.read_text())


RANGE_ENDS = ("low", "high")


def at_range_end(hw_doc: dict[str, Any], end: str) -> dict[str, Any]:
    """A copy of a hardware profile whose ranged allreduce figures (box 'ranges') are scaled from the value
    used to the range's ``end`` ('low' or 'high'), at every GPU count and size; other figures unchanged."""
    if end not in RANGE_ENDS:
        raise ValueError(f"range end must be one of {RANGE_ENDS}, not {end!r}")
    doc = copy.deepcopy(hw_doc)
    box = doc.get("box") or {}
    for path, rng in (box.get("ranges") or {}).items():
        scale = rng[f"{end}_us"] / rng["used_us"]
        for tables in (box.get("allreduce_us") or {}).values():
            if path in tables:
                tables[path] = {size: us * scale for size, us in tables[path].items()}
    return doc


def predict(point: dict[str, Any], repo_root: Path, range_end: str | None = None, bands: dict[str, Any] | None = None) -> Row:
    """Plan one published configuration with the catalogue and read back the named strategy
    (with ranged allreduce figures at ``range_end`` when given: at_range_end)."""
    from v100plan import catalogue, plan_inputs
    from v100plan.planner import Target, hardware_from_doc, plan

    model = point["model"]
    if model not in catalogue.ids("model"):
        model = str(repo_root / model)
    engine = plan_inputs.engine(point["engine"])
    m, alts = plan_inputs.load_model(model, point.get("weights"), point.get("kv_cache_dtype"), engine)
    hw_doc = catalogue.get("hardware", point["hardware"])
    hw = hardware_from_doc(at_range_end(hw_doc, range_end) if range_end else hw_doc, point["gpus"])
    target = Target(context_tokens=int(point["context_tokens"]), gpus=hw.gpus, acceptance=point.get("acceptance"),
                    draft_tokens=point.get("draft_tokens"))
    p = plan(hw, m, engine, target, alternatives=alts, bands=bands)
    s = p.strategy(point["strategy"])
    from v100plan.planner.calibration import stand_in_line

    return Row(id=point["id"], role=point["role"], engine=point["engine"], hardware=point["hardware"], gpus=point["gpus"],
               strategy=point["strategy"], model=point["model"], weights=point.get("weights"),
               context_tokens=int(point["context_tokens"]), published_tok_s=float(point["decode_tok_s"]),
               predicted_tok_s=s.decode_tok_s if s.fits else None, ceiling_tok_s=s.decode_ceiling_tok_s,
               source=point["source"], figure=point["figure"], notes=tuple(p.notes) + ((s.reason,) if not s.fits else ()),
               speeds_stand_in=stand_in_line(p.speeds) if p.speeds else None,
               stand_in=(p.speeds or {}).get("stand_in"), interval=s.decode_tok_s_interval if s.fits else None)


def evaluate(repo_root: Path, path: Path = PUBLISHED, range_end: str | None = None,
             bands: dict[str, Any] | None = None) -> list[Row]:
    return [predict(pt, repo_root, range_end, bands) for pt in load_points(path)["points"]]


def summary(rows: list[Row]) -> dict[str, Any]:
    """Median and worst |error| over the held-out points, and the same over those a stand-in calibration predicted
    (calibration.py: no calibration of their own for that engine, card generation and format)."""
    held = [r for r in rows if r.role == "held_out" and r.error is not None]
    errs = [abs(r.error) for r in held]
    stood = [abs(r.error) for r in held if r.speeds_stand_in]
    return {
        "held_out_stand_in": {"points": len(stood), "median_abs_error": statistics.median(stood) if stood else None,
                              "worst_abs_error": max(stood) if stood else None,
                              "ids": [r.id for r in held if r.speeds_stand_in]},
        "points": len(rows), "held_out": len([r for r in rows if r.role == "held_out"]),
        "held_out_predicted": len(held),
        "held_out_median_abs_error": statistics.median(errs) if errs else None,
        "held_out_worst_abs_error": max(errs) if errs else None,
        "calibration_median_abs_error": statistics.median([abs(r.error) for r in rows if r.role == "calibration" and r.error is not None] or [0.0]),
        "coverage": coverage(rows),
        "over_ceiling": [r.id for r in rows if r.under_ceiling is False],
        "no_ceiling": [r.id for r in rows if r.under_ceiling is None],
    }


def coverage(rows: list[Row]) -> dict[str, dict[str, Any]]:
    """By role: points with an interval, how many published figures fell inside it, and the share."""
    out = {}
    for role in ("calibration", "held_out"):
        judged = [r for r in rows if r.role == role and r.covered is not None]
        inside = sum(1 for r in judged if r.covered)
        out[role] = {"points": len(judged), "inside": inside, "share": inside / len(judged) if judged else None}
    return out


def goal_met(s: dict[str, Any]) -> bool:
    med, worst = s["held_out_median_abs_error"], s["held_out_worst_abs_error"]
    return med is not None and med <= GOAL_MEDIAN and worst <= GOAL_WORST


def document(rows: list[Row], data: Path, range_end: str | None) -> dict[str, Any]:
    """The `bench planner --json` document (kind "planner_accuracy"): the summary against the goal and every row."""
    from profiles.document import SCHEMA_VERSIONS, provenance

    s = summary(rows)
    fields = ("id", "role", "engine", "hardware", "gpus", "strategy", "model", "weights", "context_tokens",
              "published_tok_s", "predicted_tok_s", "ceiling_tok_s", "error", "source", "figure", "speeds_stand_in", "interval")
    return {"kind": "planner_accuracy", "schema_version": SCHEMA_VERSIONS["planner_accuracy"],
            "provenance": provenance({"data": str(data), "allreduce_range": range_end or "used"}),
            "summary": {**s, "goal": {"median_abs_error": GOAL_MEDIAN, "worst_abs_error": GOAL_WORST},
                        "goal_met": goal_met(s), "allreduce_range": range_end or "used"},
            "rows": [{**{f: getattr(r, f) for f in fields}, "inside_interval": r.covered} for r in rows]}
