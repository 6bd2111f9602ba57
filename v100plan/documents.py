"""Reading and validating documents: JSON Schema (2020-12) plus the schema_version rule.

A bad document is rejected with the file, the JSON path of the first problem and
what was expected there (``DocumentError``); ``problems()`` lists them all.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource

import profiles
from profiles.document import SCHEMA_VERSIONS, version_problem
from v100plan.errors import DocumentError


@functools.lru_cache(maxsize=None)
def _registry() -> Registry:
    """Every schema under profiles/schema, addressable by file name ($ref: "common.schema.json#/...")."""
    resources = []
    for path in sorted(profiles.SCHEMA_DIR.glob("*.schema.json")):
        contents = json.loads(path.read_text())
        resources.append((path.name, Resource.from_contents(contents)))
    return Registry().with_resources(resources)


@functools.lru_cache(maxsize=None)
def _validator(kind: str) -> jsonschema.protocols.Validator:
    path = profiles.schema_path(kind)
    if not path.exists():
        raise DocumentError(str(path), f"no schema for document kind {kind!r}")
    schema = json.loads(path.read_text())
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, registry=_registry(), format_checker=cls.FORMAT_CHECKER)


def _json_path(error: jsonschema.ValidationError) -> str:
    return error.json_path if hasattr(error, "json_path") else "$"


def problems(doc: Any, kind: str) -> list[tuple[str, str]]:
    """Every (JSON path, what was expected) pair wrong with ``doc`` as a ``kind`` document."""
    if isinstance(doc, dict) and "schema_version" in doc:
        why = version_problem(kind, doc["schema_version"])
        if why:
            return [("$.schema_version", why)]
    errors = sorted(_validator(kind).iter_errors(doc), key=lambda e: (list(e.absolute_path), e.message))
    return [(_json_path(e), e.message) for e in errors]


def validate(doc: Any, kind: str, source: str = "<document>") -> dict[str, Any]:
    """Return ``doc`` if it is a valid ``kind`` document, else raise DocumentError for the first problem."""
    found = problems(doc, kind)
    if found:
        path, what = found[0]
        more = f" (and {len(found) - 1} more problem(s))" if len(found) > 1 else ""
        raise DocumentError(source, what + more, json_path=path)
    return doc


def read_json(path: str | Path) -> Any:
    p = Path(path)
    if not p.exists():
        raise DocumentError(str(p), "file not found", hint="check the path; `v100plan profiles list` shows catalogue ids")
    if p.is_dir():
        raise DocumentError(str(p), "is a directory, expected a JSON file")
    try:
        return json.loads(p.read_text())
    except UnicodeDecodeError:
        raise DocumentError(str(p), "not a text file; expected JSON") from None
    except json.JSONDecodeError as e:
        raise DocumentError(str(p), f"not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None


def load(path: str | Path, kind: str) -> dict[str, Any]:
    """Read a JSON file and validate it as a ``kind`` document.

    A document that declares another kind is refused with that kind named (not with the
    first schema problem it happens to have).
    """
    doc = read_json(path)
    expect_kind(doc, (kind,), str(path))
    return validate(doc, kind, source=str(path))


def expect_kind(doc: Any, kinds: tuple[str, ...], source: str, hint: str | None = None,
                required: bool = False) -> str | None:
    """The one wording for a document of the wrong kind: 'expected a X document, found kind Y'.

    A document without a ``kind`` passes here (its schema then says what is wrong) unless
    ``required`` is set."""
    want = " or ".join(kinds)
    article = "an" if want[0] in "aeiou" else "a"
    if not isinstance(doc, dict):
        raise DocumentError(source, f"expected {article} {want} document (a JSON object)", hint=hint)
    found = doc.get("kind")
    if (found is not None or required) and found not in kinds:
        raise DocumentError(source, f"expected {article} {want} document, found "
                            + (f"kind {found!r}" if found is not None else "no 'kind' field"), hint=hint)
    return found


def detect_kind(doc: Any) -> str | None:
    """The document kind a JSON object declares through its ``kind`` field, if any."""
    if isinstance(doc, dict) and doc.get("kind") in SCHEMA_VERSIONS:
        return doc["kind"]
    return None
