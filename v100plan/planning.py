"""The documents behind `plan`, `compare` and `profiles`: a Plan, a comparison and the catalogue listing.

Inputs come as the CLI gives them (catalogue ids, file paths, "200K") or, for the hardware, as a probe
report already in memory (qualify's own probe); the pure planner computes, each document is validated
against its schema before it is returned."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from profiles.document import SCHEMA_VERSIONS, stamp
from v100plan import catalogue, documents, interval_fit, plan_inputs
from v100plan.errors import BadInput, DocumentError, UnknownId
from v100plan.planner import Target, hardware_from_doc, plan
from v100plan.planner.calibration import stand_in_line
from v100plan.planner.from_probe import hardware_from_probe
from v100plan.planner.uncertainty import overlap
from v100plan.profile_checks import catalogue_problems
from v100plan.units import parse_tokens

DEFAULT_HARDWARE = "v100-pg500-216"
DEFAULT_GPUS = 2
DEFAULT_MODEL = "qwen3.5-27b"   # the catalogue's 4-bit groupwise-int 27B hybrid (an alias of qwen3.8-27b-groupwise-int)
DEFAULT_ENGINE = catalogue.BUNDLED_ENGINE
WORKLOADS = ("prose", "code")
DEFAULT_WORKLOAD = "prose"
DEFAULT_CONTEXT = "200K"


OBJECTIVES = ("latency", "throughput")


def _check_acceptance(acceptance: float | None) -> None:
    if acceptance is not None and not 0.0 <= acceptance <= 1.0:
        raise BadInput(f"--acceptance must be between 0 and 1, got {acceptance:g}",
                       hint="it is the per-draft-token acceptance rate: tokens per round = 1 + k x A (e.g. 0.49, 0.745)")


def _positive(name: str, value: int | None, example: str | None = None) -> None:
    if value is not None and value < 1:
        raise BadInput(f"{name} must be at least 1, got {value}", hint=f"e.g. {example or name + ' 2'}")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    """One wording for an option outside its choices (typer's own would print a library's message)."""
    if value not in choices:
        raise BadInput(f"{name} must be one of {', '.join(choices)}, got {value!r}", hint=f"e.g. {name} {choices[0]}")
    return value


def load_hardware(spec: str | dict, gpus: int | None):
    """A catalogue id, a path to a ProbeReport (or a HardwareProfile) JSON file, or a ProbeReport document."""
    if isinstance(spec, dict):
        _validate_probe(spec, "the probe report")
        return hardware_from_probe(spec, catalogue.all_of("hardware"), "the probe report", gpus)
    if spec in catalogue.ids("hardware"):
        return hardware_from_doc(catalogue.get("hardware", spec), gpus or DEFAULT_GPUS)
    path = Path(spec)
    if not (path.exists() or spec.endswith(".json") or "/" in spec):
        raise UnknownId("hardware", spec, catalogue.ids("hardware"))
    doc = documents.read_json(path)
    kind = documents.detect_kind(doc)
    if kind == "probe_report":
        _validate_probe(doc, str(path))
        return hardware_from_probe(doc, catalogue.all_of("hardware"), str(path), gpus)
    if kind == "hardware_profile":
        documents.validate(doc, kind, source=str(path))
        from dataclasses import replace

        return replace(hardware_from_doc(doc, gpus or DEFAULT_GPUS), origin=str(path))
    raise DocumentError(str(path), f"expected a probe_report or hardware_profile document, found kind {doc.get('kind')!r}"
                        if isinstance(doc, dict) else "expected a JSON object")


def load_engine(spec: str):
    """A catalogue engine id (or an older id it lists as an alias), or a path to an EngineProfile JSON file."""
    spec = catalogue.engine_id(spec)
    if spec in catalogue.ids("engine"):
        return plan_inputs.engine(spec)
    path = Path(spec)
    if not (path.exists() or spec.endswith(".json") or "/" in spec):
        raise UnknownId("engine", spec, catalogue.ids("engine"))
    doc = documents.read_json(path)
    kind = documents.detect_kind(doc)
    if kind != "engine_profile":
        raise DocumentError(str(path), f"expected an engine_profile document, found kind {doc.get('kind')!r}"
                            if isinstance(doc, dict) else "expected a JSON object",
                            hint="`v100plan bench tp2 --profile-out F` or `v100plan bench engine` writes one")
    return plan_inputs.engine(documents.validate(doc, kind, source=str(path)))


def _validate_probe(doc: dict[str, Any], source: str) -> None:
    import profiles

    if profiles.schema_path("probe_report").exists():
        documents.validate(doc, "probe_report", source=source)
        return
    # Without the schema file, still refuse another major version.
    from profiles.document import version_problem

    why = version_problem("probe_report", doc.get("schema_version"))
    if why:
        raise DocumentError(source, why, json_path="$.schema_version")


def plan_document(hardware: str | dict, gpus: int | None, model: str, engine: str | None, context: str, acceptance: float | None,
                  concurrency: int, objective: str, weights: str | None = None, kv_cache_dtype: str | None = None,
                  draft_tokens: int | None = None, draft_model: str | None = None, nodes: int = 1,
                  workload: str = DEFAULT_WORKLOAD) -> dict[str, Any]:
    """One Plan document (kind "plan") for the CLI's inputs."""
    tokens = parse_tokens(context)
    _choice("--objective", objective, OBJECTIVES)
    _choice("--workload", workload, WORKLOADS)
    _check_acceptance(acceptance)
    _positive("--gpus", gpus)
    _positive("--concurrency", concurrency)
    _positive("--nodes", nodes)
    if draft_tokens is not None and draft_tokens < 0:
        raise BadInput(f"--draft-tokens must be 0 or more, got {draft_tokens}", hint="e.g. --draft-tokens 3")
    hw = plan_inputs.with_nodes(load_hardware(hardware, gpus), nodes)
    engine = engine or catalogue.default_engine(hw.card.architecture)
    e = load_engine(engine)
    m, alternatives = plan_inputs.load_model(model, weights, kv_cache_dtype, e, draft_model, draft_tokens)
    hw = plan_inputs.with_engine_advice(hw, e)
    target = Target(context_tokens=tokens, gpus=hw.gpus, acceptance=acceptance, concurrency=concurrency, objective=objective,
                    draft_tokens=draft_tokens, workload=workload)
    result = plan(hw, m, e, target, alternatives=alternatives, bands=interval_fit.load())
    inputs = {"hardware": hardware if isinstance(hardware, str) else "the probe report", "gpus": hw.gpus, "model": model, "engine": engine, "context_tokens": tokens,
              "acceptance": acceptance, "concurrency": concurrency, "objective": objective, "workload": workload}
    inputs.update({k: v for k, v in (("weights", weights), ("kv_cache_dtype", kv_cache_dtype), ("draft_tokens", draft_tokens),
                                     ("draft_model", draft_model), ("nodes", nodes if nodes != 1 else None)) if v is not None})
    doc = {**stamp("plan", inputs), **result.to_dict()}
    return documents.validate(doc, "plan", source="the planner's output")


_HW_SPEC = re.compile(r"^(?P<id>.+?)x(?P<n>\d+)$")


def parse_hw_spec(spec: str) -> tuple[str, int]:
    """'v100-pg500-216x2' -> ('v100-pg500-216', 2); 'rtx4090-48g' -> ('rtx4090-48g', 1)."""
    if spec in catalogue.ids("hardware") or Path(spec).exists():
        return spec, 1
    m = _HW_SPEC.match(spec)
    if m and (m.group("id") in catalogue.ids("hardware") or Path(m.group("id")).exists()):
        n = int(m.group("n"))
        _positive(f"the GPU count in {spec!r}", n, example=f"{m.group('id')}x2")
        return m.group("id"), n
    raise UnknownId("hardware", spec, catalogue.ids("hardware"))


def compare_document(specs: list[str], model: str, engine: str | None, context: str, acceptance: float | None,
                     objective: str, weights: str | None = None, kv_cache_dtype: str | None = None,
                     workload: str = DEFAULT_WORKLOAD) -> dict[str, Any]:
    if not specs:
        raise BadInput("name at least one hardware to compare", hint="e.g. v100plan compare v100-pg500-216x2 rtx4090-48g")
    tokens = parse_tokens(context)
    rows = []
    for spec in specs:
        hw_id, n = parse_hw_spec(spec)
        doc = plan_document(hw_id, n, model, engine, context, acceptance, 1, objective, weights, kv_cache_dtype,
                            workload=workload)
        best = next((s for s in doc["strategies"] if s["name"] == doc["recommended"]), None)
        hw = load_hardware(hw_id, n)
        price = hw.card.price_per_card
        total = price[0] * n if price else None
        rows.append({
            "hardware": hw_id, "gpus": n, "best_strategy": doc["recommended"],
            "decode_tok_s": best["decode_tok_s"] if best else None,
            "decode_ceiling_tok_s": best["decode_ceiling_tok_s"] if best else None,
            "decode_tok_s_interval": best.get("decode_tok_s_interval") if best else None,
            "aggregate_tok_s": best["aggregate_tok_s"] if best else None,
            "prefill_s": best["prefill_s"] if best else None,
            "max_context": max((s["max_context"] for s in doc["strategies"] if s["fits"]), default=0),
            "price_total": total, "currency": price[1] if price else None,
            "price_per_decode_tok_s": round(total / best["decode_tok_s"], 1) if (total and best and best["decode_tok_s"]) else None,
            "reason": best["reason"] if best else "; ".join(f"{s['name']}: {s['reason']}" for s in doc["strategies"]),
            # Marked in the table: speeds from a calibration that stood in (v100plan/planner/calibration.py).
            "speeds_calibrated": doc["speeds"]["calibrated"] if (best and doc.get("speeds")) else None,
            "speeds_stand_in": stand_in_line(doc["speeds"]) if (best and doc.get("speeds")) else None,
        })
    fastest = max((r for r in rows if r["decode_tok_s"] is not None), key=lambda r: r["decode_tok_s"], default=None)
    for r in rows:
        r["overlaps_best"] = (overlap(r["decode_tok_s_interval"], fastest["decode_tok_s_interval"])
                              if fastest is not None and r is not fastest else None)
    inputs = {"hardware": specs, "model": model, "engine": engine or DEFAULT_ENGINE, "context_tokens": tokens,
              "acceptance": acceptance, "objective": objective, "workload": workload}
    doc = {**stamp("comparison", inputs), "inputs": inputs, "rows": rows}
    return documents.validate(doc, "comparison", source="compare")


def listing_document() -> dict[str, Any]:
    """The catalogue as one document (kind "catalogue_listing")."""
    entries = [{"catalogue": c, "id": d["id"], "name": d["name"], "status": d.get("status")}
               for c in ("hardware", "model", "engine") for d in catalogue.all_of(c)]
    doc = {**stamp("catalogue_listing", {"catalogues": ["hardware", "model", "engine"]}), "entries": entries}
    return documents.validate(doc, "catalogue_listing", source="profiles list")


def validation_document(paths: list[Path] | None) -> dict[str, Any]:
    """Each file checked against its schema (catalogue files also against the source rule); None = the
    whole catalogue. One document (kind "validation_report")."""
    paths = paths or [catalogue.path_of(c, i) for c in ("hardware", "model", "engine") for i in catalogue.ids(c)]
    results = []
    for p in paths:
        found: list[tuple[str, str]]
        try:
            doc = documents.read_json(p)
        except DocumentError as e:
            results.append({"file": str(p), "kind": None, "problems": [{"path": "$", "problem": e.problem}]})
            continue
        kind = documents.detect_kind(doc)
        if kind is None:
            found = [("$.kind", f"'kind' must be one of {', '.join(SCHEMA_VERSIONS)}")]
        else:
            found = documents.problems(doc, kind)
            if not found and kind in catalogue.KINDS.values():
                found = catalogue_problems(doc, p)
        results.append({"file": str(p), "kind": kind, "problems": [{"path": a, "problem": b} for a, b in found]})
    doc = {**stamp("validation_report", {"files": [str(p) for p in paths]}),
           "valid": not any(r["problems"] for r in results), "files": results}
    return documents.validate(doc, "validation_report", source="profiles validate")


def profile_rows(doc: dict) -> tuple[list[list[str]], list[list[str]]]:
    """A profile document as (field, value) rows and (field, source) rows, nested fields dotted.

    Every `sources` map, at any depth, becomes source rows named after the field they cite; lists of
    scalars are joined, lists of objects are counted (the JSON form has them whole)."""
    fields: list[list[str]] = []
    sources: list[list[str]] = []

    def walk(obj: dict, prefix: str) -> None:
        for key, value in obj.items():
            name = f"{prefix}{key}"
            if key == "sources" and isinstance(value, dict):
                sources.extend([f"{prefix}{k}", str(v)] for k, v in value.items())
            elif key == "provenance":
                continue
            elif isinstance(value, dict):
                if value:
                    walk(value, name + ".")
            elif isinstance(value, list):
                if value and all(isinstance(v, dict) for v in value):
                    fields.append([name, f"{len(value)} entries (--json shows them)"])
                elif value:
                    fields.append([name, ", ".join(str(v) for v in value)])
            elif value is not None:
                fields.append([name, str(value)])

    walk(doc, "")
    return fields, sources
