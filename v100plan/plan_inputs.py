"""The planner's inputs, read from the catalogue (or files) and handed to the pure planner.

The catalogue (v100plan/catalogue.py) only finds and validates documents; the planner (v100plan/planner/)
only does arithmetic over what it is given. This module is the one place that joins them: it reads the
documents, turns them into the planner's dataclasses (a config.json into a model profile first) and passes
them on, so neither side imports the other.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from v100plan import catalogue, documents
from v100plan.errors import UnknownId
from v100plan.planner import engine_from_doc, from_config, model_from_doc
from v100plan.planner.formats import kv_dtype


def engine(id_or_doc: str | dict[str, Any]) -> Any:
    """The Engine for a catalogue id (or alias) or a validated document, its stand-in read from the catalogue."""
    doc = catalogue.get("engine", catalogue.engine_id(id_or_doc)) if isinstance(id_or_doc, str) else id_or_doc
    return engine_from_doc(doc, catalogue.engine_docs())


def model_document(spec: str, weights: str | None = None, kv_cache_dtype: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """A validated model_profile document for ``spec`` (catalogue id or alias, config.json or model directory),
    in weight format ``weights`` and KV type ``kv_cache_dtype`` when given; plus notes for the plan.

    A catalogue id keeps its own format unless ``weights`` is given. A file that is itself a
    model_profile document is read as one."""
    notes: list[str] = []
    spec_id = catalogue.model_id(spec)
    if spec_id in catalogue.ids("model"):
        doc = catalogue.get("model", spec_id)
        if spec_id != spec:
            notes.append(f"--model {spec}: the catalogue's {spec_id} profile")
        if weights:
            doc, more = from_config.reformat_doc(doc, weights, catalogue.all_of("model"))
            notes += more
    elif catalogue.looks_like_path(spec):
        cfg, src = catalogue.read_config(spec)
        if cfg.get("kind") == "model_profile":
            doc = documents.validate(cfg, "model_profile", source=src)
            if weights:
                doc, notes = from_config.reformat_doc(doc, weights, [])
        else:
            doc = from_config.model_doc(cfg, src, weights, kv_cache_dtype)
    else:
        raise UnknownId("model", spec, catalogue.ids("model"))
    if kv_cache_dtype and doc["kv_cache"]["dtype"] != kv_cache_dtype:
        doc = from_config.with_kv_dtype(doc, kv_cache_dtype)
    return documents.validate(doc, "model_profile", source=spec), notes


def load_model(spec: str, weights: str | None, kv_cache_dtype: str | None, engine: Any = None,
               draft_model: str | None = None, draft_tokens: int | None = None) -> tuple[Any, tuple[Any, ...]]:
    """(Model, the same family's other catalogue formats) for the planner.

    A model read from config.json takes the engine's default KV type when --kv-cache-dtype is not given;
    a catalogue model keeps its own. A separate draft model sets the draft head's bytes (read once per draft
    step). The notes of a re-expressed format travel in the model's assumptions."""
    kv = kv_cache_dtype
    in_catalogue = catalogue.model_id(spec) in catalogue.ids("model")
    if kv is None and not in_catalogue and engine is not None and kv_dtype(engine.kv_cache_dtype or ""):
        kv = engine.kv_cache_dtype
    doc, notes = model_document(spec, weights, kv)
    m = model_from_doc(doc)
    if notes:
        m = replace(m, assumptions=tuple(dict.fromkeys(m.assumptions + tuple(notes))))
    if draft_model:
        ddoc, _ = model_document(draft_model, weights, kv)
        d = model_from_doc(ddoc)
        m = replace(m, draft_kind="model", draft_read_gb=d.decode_read_gb, draft_layers=d.layers, max_draft_tokens=max(draft_tokens or 0, 1),
                    weights_total_gb=m.weights_total_gb + d.weights_total_gb,
                    weights_replicated_gb=m.weights_replicated_gb + d.weights_total_gb,
                    assumptions=m.assumptions + (f"draft model {d.id}: {d.decode_read_gb:.2f} GB read per draft step, "
                                                 f"{d.weights_total_gb:.2f} GB held whole on every card",))
    elif draft_tokens and m.max_draft_tokens:
        m = replace(m, max_draft_tokens=max(m.max_draft_tokens, draft_tokens))
    alternatives: tuple[Any, ...] = ()
    if in_catalogue:
        alternatives = tuple(model_from_doc(d) for d in catalogue.all_of("model") if d.get("family") == m.family)
    return m, alternatives


def with_nodes(hardware: Any, nodes: int) -> Any:
    """The hardware with ``nodes`` boxes (1: unchanged)."""
    return hardware if nodes == 1 else replace(hardware, nodes=nodes)


def with_engine_advice(hardware: Any, engine_: Any) -> Any:
    """A note naming catalogue engines calibrated on this card's generation when ``engine_`` is not."""
    gen = hardware.card.architecture
    have = engine_.calibrated_generations()
    if not gen or not have or gen in have:
        return hardware
    better = [d["id"] for d in catalogue.all_of("engine") if d["id"] != engine_.id
              and gen in engine_from_doc(d).calibrated_generations()]
    note = (f"engine {engine_.id} is calibrated on {', '.join(have)} cards, not {gen}"
            + (f"; calibrated on {gen}: {', '.join(better)}" if better else "; no catalogue engine is calibrated on " + gen))
    return replace(hardware, notes=hardware.notes + (note,))
