"""Which pip extra brings which optional package, and the one message for a missing one.

The base install is the planner; deploy, accept, the engine and the probes each need an extra
(pyproject.toml, [project.optional-dependencies]). A command that lacks one says which to install and
exits 4 (an environment problem), never "internal error ... this is a bug"."""

from __future__ import annotations

import importlib.util

from v100plan.errors import EnvironmentProblem

# top-level module -> the extra that installs it
EXTRA_OF = {
    "fabric": "deploy", "paramiko": "deploy", "invoke": "deploy",
    "httpx": "accept", "openai": "accept",
    "fastapi": "serve", "uvicorn": "serve", "supervisor": "serve",
    "torch": "engine", "numpy": "engine", "safetensors": "engine", "tokenizers": "engine",
    "pynvml": "probes",
}


def missing(module: str, what: str) -> EnvironmentProblem:
    """The error for `module` not being installed, naming the extra that brings it."""
    extra = EXTRA_OF.get(module.split(".")[0])
    hint = f"pip install 'v100plan[{extra}]'" if extra else f"pip install {module.split('.')[0]}"
    return EnvironmentProblem(f"{what} needs the Python package {module.split('.')[0]!r}, which is not installed "
                              "here", hint=hint)


def from_import_error(e: ModuleNotFoundError, what: str) -> EnvironmentProblem | None:
    """A missing optional package as an EnvironmentProblem; None when the module is none of the extras'."""
    name = (e.name or "").split(".")[0]
    return missing(name, what) if name in EXTRA_OF else None


def require(extra: str, what: str) -> None:
    """Refuse early (exit 4, the pip command in the hint) when `extra`'s packages are not importable."""
    for module, of in EXTRA_OF.items():
        if of == extra and module != "invoke" and importlib.util.find_spec(module) is None:
            raise missing(module, what)
