"""Fit the planner's prediction intervals (profiles/published/intervals.json) on training data only.

Inputs, never a held-out point:
- the rows of profiles/published/decode-batch1.json that an efficiency was not set from (its points marked
  'calibration' reproduce their own figure by construction, so they say nothing of the error);
- profiles/published/interval-training.json: past errors by rung (each with its quoted line) and measured
  prefill times beside the planner's own.

Per rung (v100plan/planner/uncertainty.py) the band is the 10th and 90th percentile of published / predicted
(inclusive quantiles); a rung's band is widened to contain the one before it, so a stand-in is never
narrower than a calibration; a rung without points of its own (the kernel model) takes the next wider
rung's. Prefill: the calibrated band from the measured prefill points, each stand-in rung widened from it by
the same factors as decode.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import profiles
from v100plan.planner.uncertainty import RUNGS

TRAINING = Path(profiles.__file__).resolve().parent / "published" / "interval-training.json"
INTERVALS = Path(profiles.__file__).resolve().parent / "published" / "intervals.json"


def quantiles(ratios: list[float]) -> tuple[float, float]:
    """(p10, p90) of the ratios, inclusive; one point gives itself twice."""
    if len(ratios) == 1:
        return ratios[0], ratios[0]
    q = statistics.quantiles(sorted(ratios), n=10, method="inclusive")
    return q[0], q[-1]


def decode_pools(rows: list[Any], training: dict[str, Any]) -> dict[str, list[float]]:
    """Published / predicted decode by rung: the training rows (not their calibration points) and the past errors."""
    from v100plan.planner.uncertainty import rung

    pools: dict[str, list[float]] = {r: [] for r in RUNGS}
    for r in rows:
        if r.role == "calibration" or r.predicted_tok_s is None:
            continue
        pools[rung(r.stand_in)].append(r.published_tok_s / r.predicted_tok_s)
    for entry in training.get("decode_ratios", []):
        pools[entry["rung"]].extend(float(x) for x in entry["ratios"])
    return pools


def widen(pools: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Bands per rung, each containing the one before (module docstring)."""
    out: dict[str, dict[str, Any]] = {}
    prev: tuple[float, float] | None = None
    order = list(RUNGS)
    for i, name in enumerate(order):
        pool = pools.get(name) or []
        borrowed = None
        if not pool:
            borrowed = next((n for n in order[i + 1:] if pools.get(n)), None)
            pool = pools.get(borrowed, []) if borrowed else []
        p10, p90 = quantiles(pool) if pool else (prev or (1.0, 1.0))
        if prev:
            p10, p90 = min(p10, prev[0]), max(p90, prev[1])
        prev = (p10, p90)
        out[name] = {"p10": round(p10, 4), "p90": round(p90, 4), "points": len(pool),
                     "source": (f"the {borrowed} rung's points (none of its own)" if borrowed else
                                "published / predicted of its own points") + (", widened to contain the rung before" if i else "")}
    return out


def prefill_ratios(training: dict[str, Any], repo_root: Path) -> list[float]:
    """Predicted / measured prefill time (= measured / predicted speed) of each training prefill point."""
    from v100plan import catalogue, plan_inputs
    from v100plan.planner import Target, hardware_from_doc, plan

    m, _ = plan_inputs.load_model(training["prefill_model"], None, None)
    out = []
    for p in training.get("prefill_points", []):
        e = plan_inputs.engine(p.get("engine") or training["prefill_engine"])
        hw = hardware_from_doc(catalogue.get("hardware", p["hardware"]), p["gpus"])
        s = plan(hw, m, e, Target(context_tokens=p["context_tokens"], gpus=p["gpus"])).strategy(p["strategy"])
        out.append(s.prefill_s / p["measured_s"])
    return out


def fit(rows: list[Any], repo_root: Path, training_path: Path = TRAINING) -> dict[str, Any]:
    """The bands document (kind "prediction_intervals")."""
    from profiles.document import SCHEMA_VERSIONS, provenance

    training = json.loads(training_path.read_text())
    decode = widen(decode_pools(rows, training))
    pf = prefill_ratios(training, repo_root)
    c10, c90 = quantiles(pf)
    cal = decode["calibrated"]
    prefill = {}
    for name, b in decode.items():
        lo, hi = b["p10"] / cal["p10"], b["p90"] / cal["p90"]
        prefill[name] = {"p10": round(min(c10, c10 * lo), 4), "p90": round(max(c90, c90 * hi), 4), "points": len(pf),
                         "source": "measured prefill of the field report against the planner" +
                                   ("" if name == "calibrated" else f", widened by decode's {name} factors")}
    u = training["unmodelled"]
    return {"kind": "prediction_intervals", "schema_version": SCHEMA_VERSIONS["prediction_intervals"],
            "provenance": provenance({"training": str(training_path.name), "rows": "decode-batch1.json (not its calibration points)"}),
            "coverage": "p10-p90: measured / predicted at the 10th and 90th percentile of past errors",
            "decode": decode, "prefill": prefill,
            "unmodelled": {"p10": u["ratio"], "p90": 1.0, "source": f"{u['source']}: {u['arithmetic']}"},
            "log_width": {k: round(math.log(v["p90"] / v["p10"]), 4) for k, v in decode.items()}}


def load(path: Path = INTERVALS) -> dict[str, Any] | None:
    """The bands document the planner is handed (None where none was fitted)."""
    from v100plan import documents

    if not path.exists():
        return None
    return documents.load(path, "prediction_intervals")
