"""The planner against published batch-1 decode figures (profiles/published/decode-batch1.json).

Each point names an engine, a card, a strategy, a model (catalogue id or config.json), a weight
format and a context; the planner predicts its decode tok/s and its ceiling. Points marked
'calibration' set an engine profile's efficiencies (the profile's 'calibration' list says how);
'held_out' points never did, so only they measure prediction:

  error = predicted / published - 1;   median and worst |error| over the held-out points.
Every published figure must also sit under the planner's ceiling (100 % bandwidth, no overhead).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import profiles

PUBLISHED = Path(profiles.__file__).resolve().parent / "published" / "decode-batch1.json"


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


def predict(point: dict[str, Any], repo_root: Path) -> Row:
    """Plan one published configuration with the catalogue and read back the named strategy."""
    from v100plan import catalogue
    from v100plan.planner import Target, engine_from_doc, hardware_from_doc, plan

    model = point["model"]
    if model not in catalogue.ids("model"):
        model = str(repo_root / model)
    engine = engine_from_doc(catalogue.get("engine", catalogue.engine_id(point["engine"])))
    m, alts = catalogue.load_model(model, point.get("weights"), point.get("kv_cache_dtype"), engine)
    hw = hardware_from_doc(catalogue.get("hardware", point["hardware"]), point["gpus"])
    target = Target(context_tokens=int(point["context_tokens"]), gpus=hw.gpus, acceptance=point.get("acceptance"),
                    draft_tokens=point.get("draft_tokens"))
    p = plan(hw, m, engine, target, alternatives=alts)
    s = p.strategy(point["strategy"])
    return Row(id=point["id"], role=point["role"], engine=point["engine"], hardware=point["hardware"], gpus=point["gpus"],
               strategy=point["strategy"], model=point["model"], weights=point.get("weights"),
               context_tokens=int(point["context_tokens"]), published_tok_s=float(point["decode_tok_s"]),
               predicted_tok_s=s.decode_tok_s if s.fits else None, ceiling_tok_s=s.decode_ceiling_tok_s,
               source=point["source"], figure=point["figure"], notes=tuple(p.notes) + ((s.reason,) if not s.fits else ()))


def evaluate(repo_root: Path, path: Path = PUBLISHED) -> list[Row]:
    return [predict(pt, repo_root) for pt in load_points(path)["points"]]


def summary(rows: list[Row]) -> dict[str, Any]:
    held = [r for r in rows if r.role == "held_out" and r.error is not None]
    errs = [abs(r.error) for r in held]
    return {
        "points": len(rows), "held_out": len([r for r in rows if r.role == "held_out"]),
        "held_out_predicted": len(held),
        "held_out_median_abs_error": statistics.median(errs) if errs else None,
        "held_out_worst_abs_error": max(errs) if errs else None,
        "calibration_median_abs_error": statistics.median([abs(r.error) for r in rows if r.role == "calibration" and r.error is not None] or [0.0]),
        "over_ceiling": [r.id for r in rows if r.under_ceiling is False],
        "no_ceiling": [r.id for r in rows if r.under_ceiling is None],
    }
