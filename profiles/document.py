"""Stdlib-only base of every v100plan document: schema versions and provenance.

Every document carries ``schema_version`` ("MAJOR.MINOR") and ``provenance``.
A reader accepts any MINOR of the MAJOR it knows and rejects another MAJOR with
a message naming both versions.

Units used across all documents (field names say which):
  bandwidth ``*_gbps`` in GB/s = 1e9 bytes/s; file and weight sizes ``*_gb`` in
  GB = 1e9 bytes; card memory ``*_gib`` in GiB as NVML reports it; clocks
  ``*_mhz``; times ``*_us`` / ``*_ms`` / ``*_s``; token counts are plain integers
  (K = 1024 when a user writes "256K").

A value that could not be had is ``null`` in its field plus an entry in the
document's (or record's) ``unavailable`` object: ``{"field_name": "reason"}``.
Never 0, never a magic string.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

TOOL = "v100plan"
TOOL_VERSION = "0.1.0"

# One entry per document kind; the kind is also the schema file's stem.
SCHEMA_VERSIONS: dict[str, str] = {
    "hardware_profile": "1.0",
    "model_profile": "1.0",
    "engine_profile": "1.0",
    "probe_report": "1.0",
    "plan": "1.0",
    "comparison": "1.0",
    "acceptance_report": "1.0",
    "catalogue_listing": "1.0",
    "validation_report": "1.0",
    "probe_bench": "1.0",
    "tp2_bench": "1.0",
    "planner_accuracy": "1.0",
    "prediction_intervals": "1.0",
    # the remote commands' --json documents (deploy, rollback, stop, remove, status, fleet probe)
    "deploy_outcome": "1.0",
    "rollback_outcome": "1.0",
    "stop_outcome": "1.0",
    "remove_outcome": "1.0",
    "deployment_status": "1.0",
    "fleet_probe": "1.0",
    "fleet_outcome": "1.0",        # deploy, rollback, status or stop over --inventory
    "api_key": "1.0",              # `v100plan key show --json`
    "key_rotate_outcome": "1.0",   # `v100plan key rotate --json`
}

_REPO_ROOT = Path(__file__).resolve().parent.parent


def git_revision() -> str | None:
    """The checkout's commit (with "-dirty" when modified), or None outside a git checkout."""
    if not (_REPO_ROOT / ".git").exists():
        return None
    try:
        rev = subprocess.run(
            ["git", "-C", str(_REPO_ROOT), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(_REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("-dirty" if dirty else "") if rev else None


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def provenance(inputs: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """Provenance block for a new document.

    ``inputs`` names what the document was computed from (ids, file paths,
    parameters). Documents made on a GPU host pass ``driver``, ``cuda``,
    ``nccl`` and ``torch`` versions through ``extra``; the method of a
    measurement (warm-up, samples, statistic) goes there too as ``method``.
    """
    block: dict[str, Any] = {
        "tool": TOOL,
        "tool_version": TOOL_VERSION,
        "git_revision": git_revision(),
        "created_utc": utc_now(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "inputs": dict(inputs or {}),
    }
    if os.environ.get("V100PLAN_SCRUB_HOST"):
        block["host"] = "scrubbed"
    block.update(extra)
    return block


def stamp(kind: str, inputs: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """The head a new document of ``kind`` starts with: ``kind``, its ``schema_version`` and ``provenance``."""
    return {"kind": kind, "schema_version": SCHEMA_VERSIONS[kind], "provenance": provenance(inputs, **extra)}


def version_problem(kind: str, found: Any) -> str | None:
    """Why a document of ``kind`` declaring ``found`` cannot be read, or None if it can."""
    expected = SCHEMA_VERSIONS[kind]
    if not isinstance(found, str) or found.count(".") != 1:
        return f"schema_version must be a string \"MAJOR.MINOR\" (this tool reads {expected}), got {found!r}"
    if found.split(".")[0] != expected.split(".")[0]:
        return (
            f"{kind} schema_version {found} is not readable by this v100plan, which reads {expected} "
            f"(major versions differ)"
        )
    return None
