"""A fake pynvml that answers from a recording made by probes/record.py on a real GPU host.

It implements the part of pynvml's interface the probes use (functions by name, constants,
NVMLError_* exceptions), so the real gateway (probes/nvml.py) and the real inventory code
run against real answers on a machine without a GPU.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any


class NVMLError(Exception):
    pass


def _obj(value: Any) -> Any:
    if isinstance(value, dict):
        return types.SimpleNamespace(**{k: _obj(v) for k, v in value.items()})
    return value


def fake_pynvml(recording: list[dict[str, Any]], constants: dict[str, int] | None = None) -> Any:
    """A module-like object; each recorded (name, args) answers its recorded value or error."""
    answers: dict[tuple[str, str], dict[str, Any]] = {}
    for entry in recording:
        answers.setdefault((entry["name"], json.dumps(entry["args"])), entry)
    errors: dict[str, type] = {}
    mod = types.SimpleNamespace(NVMLError=NVMLError)

    def handle_key(a: Any) -> Any:
        return a

    def make(name: str):
        def call(*args: Any) -> Any:
            entry = answers.get((name, json.dumps([handle_key(a) for a in args])))
            if entry is None:
                cls = errors.setdefault("NVMLError_NotSupported", type("NVMLError_NotSupported", (NVMLError,), {}))
                raise cls(f"not in the recording: {name}{args}")
            if "error" in entry:
                cls_name, message = entry["error"]
                cls = errors.setdefault(cls_name, type(cls_name, (NVMLError,), {}))
                raise cls(message)
            return _obj(entry["value"])

        return call

    for name, _args in answers:
        setattr(mod, name, make(name))
    mod.nvmlInit = lambda: None
    mod.nvmlShutdown = lambda: None
    for k, v in (constants or {}).items():
        setattr(mod, k, v)
    return mod


def load(path: str | Path) -> Any:
    doc = json.loads(Path(path).read_text())
    return fake_pynvml(doc["nvml_answers"], doc.get("constants"))
