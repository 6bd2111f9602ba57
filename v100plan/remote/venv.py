"""The Python environments v100plan builds on a host, named by their dependency set.

A venv lives in ``<remote-root>/venvs/<id>``, the id a hash of the interpreter command,
the pinned requirements, the package index and whether it sees the interpreter's site
(``--remote-site-packages``). A deploy whose dependency set did not change reuses the venv
as it is; a changed set gets a new one (the old stays until removed). Versions are pinned to
what the control machine runs, so the host runs what was tested here; with the host's site
packages, torch is the exception unless --torch pins it: the host's own build (any version)
is the point of using its site.
"""

from __future__ import annotations

import hashlib
import json
import re
from importlib import metadata

# What probes/ needs on a host (torch is optional there: the engine's venv has it).
PROBE_PACKAGES = ("nvidia-ml-py",)
# What engine/ and its service need (pyproject extras engine + serve), plus NVML for the probes: jinja2 renders
# chat templates (sandboxed), xgrammar enforces response_format and tool arguments, pillow decodes images.
ENGINE_PACKAGES = ("numpy", "safetensors", "tokenizers", "jinja2", "xgrammar", "pillow", "fastapi", "uvicorn",
                   "supervisor", "prometheus_client", "nvidia-ml-py")


def pinned(name: str) -> str:
    """``name==<the version installed here>`` (a local label such as +cpu dropped), or ``name``."""
    try:
        v = metadata.version(name)
    except metadata.PackageNotFoundError:
        return name
    return f"{name}=={re.sub(r'[+].*$', '', v)}"


def local_torch() -> str:
    return pinned("torch")


def probe_requirements() -> list[str]:
    return [pinned(p) for p in PROBE_PACKAGES]


def engine_requirements(torch_spec: str | None = None, site_packages: bool = False) -> list[str]:
    """The engine venv's requirements. ``site_packages`` (the venv sees the host interpreter's site):
    without --torch, any torch the site holds will do (``torch``, unpinned)."""
    torch = torch_spec or ("torch" if site_packages else local_torch())
    return [torch, *(pinned(p) for p in ENGINE_PACKAGES)]


def venv_id(python: str, requirements: list[str], index_url: str | None, site_packages: bool = False) -> str:
    """An isolated venv and one that sees the host's site never share an id (the key is added only when
    set, so isolated venvs keep the ids they had before the option existed)."""
    doc = {"python": python, "requirements": sorted(requirements), "index_url": index_url}
    if site_packages:
        doc["system_site_packages"] = True
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
