"""The planner's TP1 and TP2 decode predictions next to what the two-GPU bench measured.

For each context the bench ran and each allreduce path it measured, the planner is run with an
engine profile that offers only that path (so its arithmetic uses that path's figure), and its
round time is set against the measured step: error % = (predicted - measured) / measured.
The "planner" rows let the planner pick the path itself, as `v100plan plan` does. Each row's "role" says
whether its measurement set the profile ("TP1 fit", "TP2 fit": the TP2 fractions' calibration contexts)
or not ("held out"): only held-out errors say what a prediction is worth.
"""

from __future__ import annotations

import copy
from typing import Any

from v100plan import catalogue
from v100plan.calibrate import tp2_fit
from v100plan.calibrate.views import card_id_for, hardware, model_id_for
from v100plan.planner import Target, engine_from_doc, model_from_doc
from v100plan.planner.plan import plan_strategies

GRAPH_MAILBOX = "graph_mailbox"  # mode: a CUDA-graph step over engine/allreduce/graph_mailbox.py


def _measured_ms(bench: dict[str, Any], strategy: str, path: str | None, ctx: str, mode: str) -> float | None:
    key = "decode_eager" if mode == "eager" else "decode_graph"
    if mode == GRAPH_MAILBOX and path == "device_mailbox":
        path = "device_mailbox_graph"  # the experimental GPU-side mailbox stands in for device_mailbox
    if strategy == "single":
        src = ((bench.get("tp1") or {}).get("rank0") or {}).get(key) or {}
    else:
        src = ((bench.get("tp2") or {}).get(path) or {}).get(key) or {}
    return (src.get(ctx) or {}).get("ms")


def graph_mailbox_engine(bench: dict[str, Any], graph_doc: dict[str, Any]) -> dict[str, Any] | None:
    """The graph-mode profile with the GPU-side mailbox's in-graph figures as its only (device_mailbox) path,
    when the bench measured that mailbox; else None."""
    row = (bench.get("allreduce") or {}).get("device_mailbox_graph") or {}
    graph = row.get("graph_us") or {}
    if not graph or "unavailable" in graph or not all((row.get("bit_exact") or {"": False}).values()):
        return None
    doc = copy.deepcopy(graph_doc)
    doc["allreduce_paths"] = ["device_mailbox"]
    doc["allreduce_us"] = {"device_mailbox": dict(graph)}
    return doc


def _only(engine_doc: dict[str, Any], path: str) -> dict[str, Any]:
    doc = copy.deepcopy(engine_doc)
    doc["allreduce_paths"] = [path]
    return doc


def rows(bench: dict[str, Any], engine_doc: dict[str, Any], hw, model_doc: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    """One row per (context, strategy, path): predicted and measured ms and tok/s, and the error."""
    model = model_from_doc(model_doc)
    out = []
    offered = list(engine_doc["allreduce_paths"])
    paths = [None] + (offered if len(offered) > 1 else [])  # None: the planner's own choice
    for ctx in bench.get("contexts", []):
        for path in paths:
            engine = engine_from_doc(engine_doc if path is None else _only(engine_doc, path))
            p = plan_strategies(hw, model, engine, Target(context_tokens=int(ctx), gpus=2))
            by_name = {s.name: s for s in p.strategies}
            both = path is None and mode != GRAPH_MAILBOX  # TP1 does not depend on the path
            for strat in (("single", "tp2") if both else ("tp2",)):
                s = by_name[strat]
                used = s.allreduce_path if strat == "tp2" else None
                measured = _measured_ms(bench, strat, used, str(ctx), mode)
                pred = s.round_ms
                d = s.breakdown.get("decode") or {}
                out.append({
                    "context": int(ctx), "strategy": strat, "mode": mode,
                    "role": tp2_fit.role(engine_doc, bench, strat, mode, used, int(ctx)),
                    "path": used, "chosen_by": "planner" if path is None else "fixed",
                    "predicted_ms": pred, "measured_ms": measured,
                    "predicted_tok_s": s.decode_tok_s,
                    "measured_tok_s": round(1000 / measured, 2) if measured else None,
                    "error_pct": round((pred - measured) / measured * 100, 1) if (pred and measured) else None,
                    "terms_ms": {k: d.get(k) for k in ("weights_ms", "kv_ms", "overhead_ms", "allreduce_ms")},
                    "allreduce_us": d.get("allreduce_us"), "clock_ratio": d.get("clock_ratio"),
                })
    return out


def comparison(bench: dict[str, Any], engines: dict[str, dict[str, Any]], probe: dict[str, Any] | None,
               probe_source: str | None, model_doc: dict[str, Any] | None = None,
               card_id: str | None = None) -> dict[str, Any]:
    """Every mode's rows, on the probe report's view of the pair and on the catalogued card's (``card_id``,
    default the card the probe report or the bench's device names; left out when none is catalogued).
    ``model_doc``: the ModelProfile of the shape the bench ran, when the catalogue has none."""
    if model_doc is None:
        model_id = model_id_for(bench)
        if model_id is None:
            return {"rows": [], "unavailable": f"no catalogue model matches {bench.get('config')} (layers override "
                                               f"{bench.get('layers_override')}): pass its model profile"}
        model_doc = catalogue.get("model", model_id)
    model_id = model_doc["id"]
    card_id = card_id or card_id_for(bench, probe)
    views = {f"catalogue {card_id} x 2": hardware(None, None, card_id)} if card_id else {}
    if probe:
        views = {"probe report": hardware(probe, probe_source), **views}
    if not views:
        return {"model": model_id, "rows": [], "unavailable": "no probe report and the bench's card is not in the "
                                                             "catalogue: pass --probe or --hardware"}
    engines = dict(engines)
    if "graph" in engines and (gm := graph_mailbox_engine(bench, engines["graph"])):
        engines[GRAPH_MAILBOX] = gm
    out: list[dict[str, Any]] = []
    for view, hw in views.items():
        for mode, doc in engines.items():
            for r in rows(bench, doc, hw, model_doc, mode):
                out.append({"hardware": view, **r})
    return {"model": model_id, "rows": out}
