"""A served decode measurement (endpoint.py) -> EngineProfile for that engine and card, and the planner's
prediction beside every served figure.

The planner's one-card round is   t(c) = weights / (bw x f_w) + KV(c) / (bw x f_k) + overhead,
with KV(c) = K/V bytes per token x c. The served points give a straight line t = a + b x KV(c) (least squares
over the fitted points, the smallest and the largest context; the ones between are held out and judged):

  f_k = 1 / (bw x b)                   (the slope: what a GB more of K/V costs)
  f_w = weights / (bw x a)             (the intercept: one served model cannot split it into bytes and a fixed
                                        cost, so all of it is put on the weight reads, round_overhead_ms 0)

A slope that is not positive (the contexts too short to see the K/V) makes the round one constant, the mean of the
fitted points, and leaves f_k = f_w; the profile says so.
``weights`` and ``bw`` are the planner's own for that model and card, so a plan with this profile gives back the
fitted points by construction; the held-out points test the straight line.
"""

from __future__ import annotations

from typing import Any

from profiles.document import SCHEMA_VERSIONS, provenance
from v100plan.calibrate.endpoint import Measurement
from v100plan.calibrate.fit import line_fit
from v100plan.errors import BadInput
from v100plan.planner import Target, engine_from_doc, plan
from v100plan.planner.inputs import Hardware, Model


def fitted_indices(n: int) -> list[int]:
    """Which points set the line: the first and the last (all of them when there are two)."""
    return [0, n - 1] if n > 2 else list(range(n))


def _weights_gb(model: Model) -> float:
    return model.decode_read_gb + model.state_bytes_per_sequence / 1e9


def engine_profile(m: Measurement, model: Model, hw: Hardware, profile_id: str) -> dict[str, Any]:
    """The EngineProfile document (module docstring) for what ``m`` measured."""
    if len(m.points) < 2:
        raise BadInput(f"{len(m.points)} prompt size(s) fit under the server's limit ({m.max_model_len} tokens): a fit needs two",
                       hint="give smaller --prompt-tokens sizes, or --long fewer tokens")
    bw = float(hw.card.read_bw.value)
    fit = fitted_indices(len(m.points))
    xs = [(model.kv_bytes_per_token * m.points[i].context_tokens / 1e9, m.points[i].ms_per_token) for i in fit]
    a, b = line_fit(xs)
    if b <= 0:
        # No K/V cost to see over these contexts (noise beat it): the round is one constant, their mean.
        a, b = sum(x[1] for x in xs) / len(xs), 0.0
    where = f"{m.endpoint} serving {m.model}"
    if a <= 0:
        raise BadInput(f"the served step has no positive intercept ({a:.3f} ms at no K/V): the points are too noisy to fit",
                       hint="raise --repeats, or widen the prompt sizes")
    fw = _weights_gb(model) / (bw * a) * 1e3
    kv_note = f"1 / ({bw:g} GB/s x slope {b:.4f} ms/GB)"
    fk = 1e3 / (bw * b) if b > 0 else fw
    if b <= 0:
        kv_note = f"slope {b:.4f} ms/GB is not positive (contexts too short to see the K/V): the weight fraction stands in"
    too_fast = [n for n, v in (("weight", fw), ("K/V", fk)) if v > 1]
    if too_fast:
        raise BadInput(f"{where} decodes faster than {hw.card.id}'s {bw:g} GB/s allows ({' and '.join(too_fast)} fraction "
                       f"{max(fw, fk):.2f} > 1)", hint="give the --hardware the server runs on (a probe report of its card)")
    src = f"measured: v100plan calibrate on {where}, card {hw.card.id} ({bw:g} GB/s), model {model.id}"
    ctxs = [m.points[i].context_tokens for i in fit]
    gen = hw.card.architecture or "unknown"
    measured = {
        "weight_bw_fraction": {"value": round(fw, 6), "source": src, "note":
                               f"intercept {a:.3f} ms for {_weights_gb(model):.4f} GB: all of it on the weight reads"},
        "kv_bw_fraction": {"value": round(fk, 6), "source": src, "note": kv_note},
        "round_overhead_ms": {"value": 0.0, "source": src, "note": "one served model cannot split the intercept into "
                              "bytes and a fixed cost: all of it is in weight_bw_fraction"},
    }
    # The figures hold for this card's generation: on another, a plan says they stand in (calibration.py's chain).
    only = f"measured on {hw.card.id} ({gen}) only: see by_generation"
    efficiency = {k: {"value": None, "source": only} for k in measured}
    efficiency["prefill_compute_fraction"] = {"value": None, "source": "not measured by calibrate (prefill is subtracted)"}
    arithmetic = (f"t = a + b x KV over the fitted points {ctxs}: a = {a:.4f} ms, b = {b:.4f} ms/GB; "
                  f"f_w = {_weights_gb(model):.4f} GB / ({bw:g} GB/s x a) = {fw:.4f}; f_k = {kv_note} = {fk:.4f}")
    return {
        "kind": "engine_profile", "schema_version": SCHEMA_VERSIONS["engine_profile"],
        "provenance": provenance({"endpoint": m.endpoint, "served_model": m.model, "model": model.id, "hardware": hw.origin},
                                 method="ms per token = (fastest time of the long - of the short generation) / (their "
                                        "token difference), same prompt, temperature 0"
                                        + (", ignore_eos" if m.ignore_eos else ", the server's own token counts")),
        "id": profile_id, "name": f"{m.model} as served at {m.endpoint}, measured on {hw.card.id}",
        "description": f"One stream's decode of {where}, measured by v100plan calibrate at {len(m.points)} contexts; "
                       f"fractions of {hw.card.id}'s {bw:g} GB/s for {model.id}.",
        "status": "measured", "efficiency": efficiency, "by_generation": {gen: measured}, "launch_kind": "",
        "speculative": {"draft_tokens": 0, "default_acceptance": 0.0, "source": "measured without speculation"},
        "allreduce_paths": [], "allreduce_us": {},
        "calibration": [{"key": "served_decode", "parameter": "weight_bw_fraction, kv_bw_fraction",
                         "figure": "; ".join(f"{p.ms_per_token:.3f} ms/token at {p.context_tokens} tokens" for p in m.points),
                         "arithmetic": arithmetic, "contexts": ctxs}],
        "measurement": {"endpoint": m.endpoint, "served_model": m.model, "max_model_len": m.max_model_len,
                        "ignore_eos": m.ignore_eos, "points": [p.to_dict() for p in m.points], "skipped": m.skipped},
    }


def side_by_side(doc: dict[str, Any], m: Measurement, model: Model, hw: Hardware) -> list[dict[str, Any]]:
    """Every served point beside what `plan --engine` with the profile predicts for it (one card, one stream)."""
    engine = engine_from_doc(doc)
    fit = set(fitted_indices(len(m.points)))
    rows = []
    for i, p in enumerate(m.points):
        s = plan(hw, model, engine, Target(context_tokens=p.context_tokens, gpus=1)).strategy("single")
        served = 1e3 / p.ms_per_token
        rows.append({"context_tokens": p.context_tokens, "role": "fitted" if i in fit else "held_out",
                     "served_tok_s": round(served, 3), "predicted_tok_s": s.decode_tok_s,
                     "error": None if s.decode_tok_s is None else round(s.decode_tok_s / served - 1, 4)})
    return rows


def calibrate(client: Any, model: Model, hw: Hardware, prompt_sizes: list[int], short: int, long: int, repeats: int,
              profile_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Measure the endpoint (endpoint.measure), build its EngineProfile and the side-by-side rows."""
    from v100plan import documents
    from v100plan.calibrate.endpoint import measure

    m = measure(client, prompt_sizes, short, long, repeats)
    doc = documents.validate(engine_profile(m, model, hw, profile_id), "engine_profile", source="calibrate")
    return doc, side_by_side(doc, m, model, hw)
