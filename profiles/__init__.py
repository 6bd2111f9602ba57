"""The catalogue (hardware, models, engines), the JSON Schemas of every document
v100plan exchanges, and the stdlib-only document base shared by all parts.

This package is data plus standard library only: probes/ and engine/ import it on
GPU hosts, v100plan/ imports it on the operator's machine.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent
SCHEMA_DIR = ROOT / "schema"
CATALOGUES = {"hardware": ROOT / "hardware", "model": ROOT / "models", "engine": ROOT / "engines"}


def schema_path(kind: str) -> Path:
    """Path of the JSON Schema for a document kind (e.g. "plan" -> schema/plan.schema.json)."""
    return SCHEMA_DIR / f"{kind}.schema.json"
