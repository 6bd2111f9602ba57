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


def engine_docs() -> dict[str, dict[str, Any]]:
    """Every catalogue engine document by id (what the planner reads a profile's stand_in_engine from)."""
    return {i: get("engine", i) for i in ids("engine")}


def model_id(spec: str) -> str:
    """A catalogue model id, resolving the names users give a model (a profile's 'aliases': qwen3.5-27b, ...)."""
    if spec in ids("model"):
        return spec
    for doc in all_of("model"):
        if spec.lower() in (a.lower() for a in doc.get("aliases") or ()):
            return doc["id"]
    return spec


# The engine a plan uses when none is named: the bundled one, the engine every user can launch
# (`python -m engine serve`, `v100plan deploy`). An engine that is not bundled is planned only when asked for.
BUNDLED_ENGINE = "v100plan"


def default_engine(architecture: str) -> str:  # noqa: ARG001 - one answer for every card generation, on purpose
    """The engine id a plan uses without --engine: the bundled engine on every card generation."""
    return BUNDLED_ENGINE


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
