"""The catalogue under profiles/: hardware, models and engines, one JSON file per id.

A file's stem is its id (profiles/hardware/v100-pg500-216.json -> "v100-pg500-216")
and must equal the ``id`` inside it. Every file is validated when read.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import profiles
from v100plan import documents
from v100plan.errors import UnknownId

# catalogue name -> document kind (schema stem)
KINDS = {"hardware": "hardware_profile", "model": "model_profile", "engine": "engine_profile"}


def ids(catalogue: str) -> list[str]:
    return sorted(p.stem for p in profiles.CATALOGUES[catalogue].glob("*.json"))


def path_of(catalogue: str, id_: str) -> Path:
    return profiles.CATALOGUES[catalogue] / f"{id_}.json"


@functools.lru_cache(maxsize=None)
def _load_cached(catalogue: str, id_: str) -> dict[str, Any]:
    return documents.load(path_of(catalogue, id_), KINDS[catalogue])


def get(catalogue: str, id_: str) -> dict[str, Any]:
    """The validated document for ``id_``; UnknownId (listing the valid ids) if there is none."""
    if id_ not in ids(catalogue):
        raise UnknownId(catalogue, id_, ids(catalogue))
    return _load_cached(catalogue, id_)


def all_of(catalogue: str) -> list[dict[str, Any]]:
    return [get(catalogue, i) for i in ids(catalogue)]


def engine_id(spec: str) -> str:
    """A catalogue engine id, resolving an older id that a profile lists in its 'aliases'."""
    if spec in ids("engine"):
        return spec
    for doc in all_of("engine"):
        if spec in (doc.get("aliases") or ()):
            return doc["id"]
    return spec


# The engine a plan uses when none is named: the first of these calibrated on the card's generation (the V100
# engine only where it was measured: Volta), else the bundled engine, which runs on any card.
DEFAULT_ENGINES = ("ninfer-v100-tp", "v100plan", "vllm", "llamacpp", "gpt-fast")


def default_engine(architecture: str) -> str:
    """The engine id for a card generation (DEFAULT_ENGINES): never the V100 engine off Volta."""
    for eid in DEFAULT_ENGINES:
        doc = get("engine", eid)
        if architecture in (doc.get("by_generation") or {}) or architecture in (doc.get("calibrated_generations") or ()):
            return eid
    return "v100plan"


def read_config(spec: str) -> tuple[dict[str, Any], str]:
    """(config dict, path) from a Hugging Face config.json or a model directory holding one."""
    import json

    from v100plan.errors import DocumentError

    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise DocumentError(str(path), "no such file",
                            hint="--model takes a catalogue id (`v100plan profiles list`), a config.json or a model directory holding one")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DocumentError(str(path), f"not readable JSON: {e}",
                            hint="fix the JSON of the model's Hugging Face config.json (or give a catalogue id); "
                                 "`v100plan profiles validate` checks v100plan's own documents, not this") from None
    if not isinstance(cfg, dict):
        raise DocumentError(str(path), "expected a JSON object (a Hugging Face config.json)")
    return cfg, str(path)


def looks_like_path(spec: str) -> bool:
    return "/" in spec or spec.endswith(".json") or Path(spec).exists()


def model_document(spec: str, weights: str | None = None, kv_cache_dtype: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """A validated model_profile document for ``spec`` (catalogue id, config.json or model directory),
    in weight format ``weights`` and KV type ``kv_cache_dtype`` when given; plus notes for the plan.

    A catalogue id keeps its own format unless ``weights`` is given. A file that is itself a
    model_profile document is read as one."""
    from v100plan.planner import from_config

    notes: list[str] = []
    if spec in ids("model"):
        doc = get("model", spec)
        if weights:
            doc, notes = from_config.reformat_doc(doc, weights, all_of("model"))
    elif looks_like_path(spec):
        cfg, src = read_config(spec)
        if cfg.get("kind") == "model_profile":
            doc = documents.validate(cfg, "model_profile", source=src)
            if weights:
                doc, notes = from_config.reformat_doc(doc, weights, [])
        else:
            doc = from_config.model_doc(cfg, src, weights, kv_cache_dtype)
    else:
        raise UnknownId("model", spec, ids("model"))
    if kv_cache_dtype and doc["kv_cache"]["dtype"] != kv_cache_dtype:
        doc = from_config.with_kv_dtype(doc, kv_cache_dtype)
    return documents.validate(doc, "model_profile", source=spec), notes


def load_model(spec: str, weights: str | None, kv_cache_dtype: str | None, engine: Any = None,
               draft_model: str | None = None, draft_tokens: int | None = None) -> tuple[Any, tuple[Any, ...]]:
    """(Model, the same family's other catalogue formats) for the planner.

    A model read from config.json takes the engine's default KV type when --kv-cache-dtype is not given;
    a catalogue model keeps its own. A separate draft model sets the draft head's bytes (read once per draft
    step). The notes of a re-expressed format travel in the model's assumptions."""
    from dataclasses import replace

    from v100plan.planner import model_from_doc
    from v100plan.planner.formats import kv_dtype

    kv = kv_cache_dtype
    if kv is None and spec not in ids("model") and engine is not None and kv_dtype(engine.kv_cache_dtype or ""):
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
    if spec in ids("model"):
        alternatives = tuple(model_from_doc(d) for d in all_of("model") if d.get("family") == m.family)
    return m, alternatives


def with_nodes(hardware: Any, nodes: int) -> Any:
    """The hardware with ``nodes`` boxes (1: unchanged)."""
    from dataclasses import replace

    return hardware if nodes == 1 else replace(hardware, nodes=nodes)


def with_engine_advice(hardware: Any, engine: Any) -> Any:
    """A note naming catalogue engines calibrated on this card's generation when ``engine`` is not."""
    from dataclasses import replace

    gen = hardware.card.architecture
    have = engine.calibrated_generations()
    if not gen or not have or gen in have:
        return hardware
    from v100plan.planner import engine_from_doc

    better = [d["id"] for d in all_of("engine") if d["id"] != engine.id and gen in engine_from_doc(d).calibrated_generations()]
    note = (f"engine {engine.id} is calibrated on {', '.join(have)} cards, not {gen}"
            + (f"; calibrated on {gen}: {', '.join(better)}" if better else "; no catalogue engine is calibrated on " + gen))
    return replace(hardware, notes=hardware.notes + (note,))
