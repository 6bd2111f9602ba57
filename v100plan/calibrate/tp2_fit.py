"""TP2 efficiencies from a two-GPU bench, fitted at a few contexts so that the others test them.

Under TP2 each card reads its shard and half of the KV heads with half-width kernels, which run less
efficiently than the full-width ones a TP1 calibration sees. The planner's TP2 round is

  round(ctx) = W / (B x tp2_weight_bw_fraction) + KV(ctx) / (B x tp2_kv_bw_fraction) + overhead + allreduces

with W and KV(ctx) one rank's bytes (the planner's own layout), B the read bandwidth the profile's
fractions refer to, and overhead and allreduces as the TP1 profile and the bench's in-graph allreduce give
them. Subtract those two from the measured TP2 CUDA-graph step at the calibration contexts only (by
default the two shortest: 1K and 4K) and fit a line over KV bytes (least squares; exact for two points):

  tp2_kv_bw_fraction     = 1 / (B x slope)
  tp2_weight_bw_fraction = W / (B x intercept)

The longer contexts never enter the fit: their error is what the TP2 prediction is worth. One line cannot
tell a TP2-specific overhead from slower weight reads, so the intercept's excess is put on the weights.
"""

from __future__ import annotations

import copy
from typing import Any

from v100plan.calibrate.fit import line_fit
from v100plan.planner import Target, engine_from_doc, model_from_doc
from v100plan.planner.plan import plan_strategies
from v100plan.planner.strategies import layout

GRAPH_KEY = "decode_graph"


class CalibrationProblem(ValueError):
    """The bench cannot set the TP2 fractions, with why (the profile then keeps the one-card ones)."""


def default_contexts(bench: dict[str, Any]) -> list[int]:
    """The two shortest contexts the bench decoded: the rest stay held out."""
    return sorted(int(c) for c in bench.get("contexts", []))[:2]


def _without_tp2(engine_doc: dict[str, Any], path: str) -> dict[str, Any]:
    doc = copy.deepcopy(engine_doc)
    for key in ("tp2_weight_bw_fraction", "tp2_kv_bw_fraction"):
        doc["efficiency"].pop(key, None)
    doc["allreduce_paths"] = [path]
    return doc


def fit(bench: dict[str, Any], engine_doc: dict[str, Any], hw, model_doc: dict[str, Any], contexts: list[int],
        path: str = "nccl") -> dict[str, Any]:
    """The two fractions and every term of their arithmetic, from the TP2 graph step on ``path`` at ``contexts``."""
    if len(contexts) < 2:
        raise CalibrationProblem("a TP2 fit needs two decode contexts")
    measured = ((bench.get("tp2") or {}).get(path) or {}).get(GRAPH_KEY) or {}
    model, engine = model_from_doc(model_doc), engine_from_doc(_without_tp2(engine_doc, path))
    lay = layout("tp2", model, 2)
    points, terms = [], []
    for ctx in contexts:
        ms = (measured.get(str(ctx)) or {}).get("ms")
        if ms is None:
            raise CalibrationProblem(f"no TP2 {path} CUDA-graph decode at {ctx} tokens in the bench")
        d = plan_strategies(hw, model, engine, Target(context_tokens=ctx, gpus=2)).strategy("tp2").breakdown.get("decode")
        if not d:
            raise CalibrationProblem(f"the planner gives no TP2 round for {model.id} at {ctx} tokens")
        kv_gb = (model.kv_bytes_per_token * ctx + model.state_bytes_per_sequence) * lay.kv_read_share / 1e9
        rest_ms = d["overhead_ms"] + d["allreduce_ms"]
        points.append((kv_gb, ms - rest_ms))
        terms.append({"context": ctx, "measured_ms": ms, "overhead_ms": d["overhead_ms"], "allreduce_ms": d["allreduce_ms"],
                      "kv_gb": round(kv_gb, 4)})
    bw = d["bandwidth_gbps"]
    intercept_ms, slope_ms_per_gb = line_fit(points)
    if slope_ms_per_gb <= 0 or intercept_ms <= 0:
        raise CalibrationProblem(f"the TP2 step does not grow with K/V bytes at {contexts} (intercept "
                                 f"{intercept_ms:.3f} ms, slope {slope_ms_per_gb:.3f} ms/GB): no fit")
    fw = lay.weights_read_gb / (bw * intercept_ms * 1e-3)
    fk = 1 / (bw * slope_ms_per_gb * 1e-3)
    if fw > 1 or fk > 1:
        raise CalibrationProblem(f"the fit says reads beat the read bandwidth (weights {fw:.3f}, K/V {fk:.3f}): "
                                 "the one-card overhead does not hold under TP2")
    return {"path": path, "contexts": list(contexts), "bench_created_utc": bench.get("created_utc"), "bandwidth_gbps": bw, "weights_gb": lay.weights_read_gb,
            "intercept_ms": intercept_ms, "slope_ms_per_gb": slope_ms_per_gb, "terms": terms,
            "tp2_weight_bw_fraction": round(fw, 4), "tp2_kv_bw_fraction": round(fk, 4)}


def apply(engine_doc: dict[str, Any], result: dict[str, Any], source: str) -> dict[str, Any]:
    """``engine_doc`` with the fitted fractions (sourced) and a calibration entry naming the contexts used."""
    doc = copy.deepcopy(engine_doc)
    ctx = " + ".join(f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in result["contexts"])
    t = result["terms"]
    rest = ", ".join(f"{x['measured_ms']:.4f} - {x['overhead_ms']:.3f} - {x['allreduce_ms']:.3f} ms at {x['kv_gb']:.4f} GB"
                     for x in t)
    src = f"calibrated: {source}, TP2 {result['path']} CUDA-graph step at {ctx} only (see calibration: tp2_graph_fit)"
    doc["efficiency"]["tp2_weight_bw_fraction"] = {
        "value": result["tp2_weight_bw_fraction"], "source": src,
        "note": f"{result['weights_gb']:.3f} GB per rank / {result['bandwidth_gbps']:g} GB/s / intercept {result['intercept_ms']:.4f} ms",
    }
    doc["efficiency"]["tp2_kv_bw_fraction"] = {
        "value": result["tp2_kv_bw_fraction"], "source": src,
        "note": f"1 / slope {result['slope_ms_per_gb']:.4f} ms per GB of a rank's K/V / {result['bandwidth_gbps']:g} GB/s",
    }
    doc.setdefault("calibration", []).append({
        "key": "tp2_graph_fit", "contexts": result["contexts"], "path": result["path"],
        "bench_created_utc": result["bench_created_utc"],
        "figure": f"{source}: TP2 {result['path']} decode step in one CUDA graph at {ctx}",
        "parameter": "tp2_weight_bw_fraction, tp2_kv_bw_fraction",
        "arithmetic": (f"measured minus overhead minus allreduces: {rest}; least-squares line over a rank's K/V GB: "
                       f"intercept {result['intercept_ms']:.4f} ms, slope {result['slope_ms_per_gb']:.4f} ms/GB -> "
                       f"weights {result['tp2_weight_bw_fraction']:g}, K/V {result['tp2_kv_bw_fraction']:g} of "
                       f"{result['bandwidth_gbps']:g} GB/s; every other context is held out"),
    })
    return doc


def fit_entry(engine_doc: dict[str, Any]) -> dict[str, Any] | None:
    """The calibration entry of a profile's TP2 fit (None when it has none)."""
    return next((e for e in engine_doc.get("calibration") or [] if e.get("key") == "tp2_graph_fit"), None)


def role(engine_doc: dict[str, Any], bench: dict[str, Any], strategy: str, mode: str, path: str | None, ctx: int) -> str:
    """Whether a comparison row's measurement set the profile: "TP1 fit", "TP2 fit", "held out", or "—" (unknown:
    the profile has no TP2 fit to say which bench it came from)."""
    fit = fit_entry(engine_doc)
    if fit is None:
        return "—"
    if fit.get("bench_created_utc") != bench.get("created_utc"):
        return "held out"  # another recording: nothing in it entered the profile
    if strategy == "single":
        return "TP1 fit"
    if mode == "graph" and path == fit.get("path") and ctx in (fit.get("contexts") or []):
        return "TP2 fit"
    return "held out"


def borrow(engine_doc: dict[str, Any], donor: dict[str, Any], why: str) -> dict[str, Any]:
    """``engine_doc`` with ``donor``'s TP2 fractions (a cross-check: the donor's fit never saw this bench)."""
    doc = copy.deepcopy(engine_doc)
    for key in ("tp2_weight_bw_fraction", "tp2_kv_bw_fraction"):
        got = (donor.get("efficiency") or {}).get(key)
        if got:
            doc["efficiency"][key] = {**got, "source": f"{why}: {got['source']}"}
    return doc
