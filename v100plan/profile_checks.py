"""Catalogue rules beyond the JSON Schema: a file's id is its name, and every number has a source.

Hardware and model profiles keep plain numbers with their source in the ``sources``
map of the same object (or an enclosing one); a null field has a reason in
``unavailable``. Engine profiles carry sourced numbers ({value, source}) instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Numbers that are identifiers or structure, not measurements.
_NOT_MEASUREMENTS = {"schema_version", "amount_is_structure"}


def unsourced_numbers(doc: dict[str, Any]) -> list[str]:
    """JSON paths of numbers (or nulls) with neither a source nor an 'unavailable' reason."""
    found: list[str] = []

    def walk(obj: Any, path: str, sources: dict[str, str], unavailable: dict[str, str]) -> None:
        if isinstance(obj, dict):
            sources = {**sources, **(obj.get("sources") or {})}
            unavailable = {**unavailable, **(obj.get("unavailable") or {})}
            for key, value in obj.items():
                if key in ("sources", "unavailable", "provenance", "allreduce_us", "calibration") or key in _NOT_MEASUREMENTS:
                    continue
                sub = f"{path}.{key}"
                if isinstance(value, bool) or isinstance(value, str):
                    continue
                if isinstance(value, (int, float)) or value is None:
                    if key not in sources and key not in unavailable:
                        found.append(sub)
                elif isinstance(value, dict) and key in sources:
                    continue  # a whole object with one source (e.g. price_per_card)
                else:
                    walk(value, sub, sources, unavailable)
        elif isinstance(obj, list):
            for n, item in enumerate(obj):
                if isinstance(item, (dict, list)):
                    walk(item, f"{path}[{n}]", sources, unavailable)

    if doc.get("kind") in ("hardware_profile", "model_profile"):
        walk(doc, "$", {}, {})
    elif doc.get("kind") == "engine_profile":
        for name, sn in (doc.get("efficiency") or {}).items():
            entries = sn.items() if name == "weight_bw_fraction_by_format" else [(name, sn)]
            for key, value in entries:
                if not (isinstance(value, dict) and value.get("source")):
                    found.append(f"$.efficiency.{name}" + ("" if key == name else f".{key}"))
    return found


def catalogue_problems(doc: dict[str, Any], path: Path) -> list[tuple[str, str]]:
    """(JSON path, problem) pairs for a profile that passed its schema. The id-is-the-file-name rule
    applies inside the catalogue only; the source rule applies to every profile."""
    import profiles

    problems = []
    in_catalogue = path.resolve().parent in {d.resolve() for d in profiles.CATALOGUES.values()}
    if in_catalogue and doc.get("id") != path.stem:
        problems.append(("$.id", f"id {doc.get('id')!r} must equal the file name {path.stem!r}"))
    problems += [(p, "a number without a source (add it to 'sources') or a null without a reason ('unavailable')")
                 for p in unsourced_numbers(doc)]
    return problems
