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
