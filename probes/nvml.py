"""The only gateway to NVML (nvidia-ml-py's ``pynvml``).

Every query goes through :func:`query`, which returns a :class:`Reading`: the
value, or ``None`` plus the reason NVML gave ("NVML answers NotSupported for
nvmlDeviceGetNvLinkState on this card"). One missing field never kills a probe.

No other module in probes/ imports pynvml; tests replace this module's
``_nvml`` attribute with a fake that raises the same errors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

_nvml: Any = None  # the pynvml module once loaded; a fake in tests
_init_problem: str | None = None
_initialised = False
_recording: list[dict[str, Any]] | None = None  # when a list, every query's raw answer is appended (record.py)


@dataclasses.dataclass(frozen=True)
class Reading:
    """One NVML answer: ``value`` or ``None`` with ``reason``."""

    value: Any
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None


def init() -> str | None:
    """Load and initialise NVML once. Returns None when usable, else why not (no driver, no library)."""
    global _nvml, _init_problem, _initialised
    if _initialised:
        return _init_problem
    _initialised = True
    if _nvml is None:
        try:
            import pynvml  # nvidia-ml-py
        except ImportError:
            _init_problem = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
            return _init_problem
        _nvml = pynvml
    try:
        _nvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        _init_problem = f"no NVIDIA driver reachable: NVML could not start ({_describe(e)})"
    return _init_problem


def reset_for_tests(fake: Any = None) -> None:
    """Forget the loaded NVML (tests plug a fake module in through this seam)."""
    global _nvml, _init_problem, _initialised
    _nvml, _init_problem, _initialised = fake, None, False


def _describe(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text


def query(name: str, *args: Any, convert: Callable[[Any], Any] | None = None) -> Reading:
    """Call ``pynvml.<name>(*args)``; turn every NVML error into a reason instead of raising.

    ``convert`` post-processes a good answer (bytes -> str, milliwatts -> watts).
    """
    problem = init()
    if problem:
        return Reading(None, problem)
    fn = getattr(_nvml, name, None)
    if fn is None:
        return Reading(None, f"this nvidia-ml-py has no {name} (too old for the query)")
    try:
        value = fn(*args)
    except Exception as e:  # noqa: BLE001 - NVMLError_* subclasses are generated at run time
        kind = type(e).__name__.replace("NVMLError_", "")
        _record(name, args, None, (type(e).__name__, _describe(e)))
        return Reading(None, f"NVML answers {kind} for {name} ({_describe(e)})")
    _record(name, args, value, None)
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if convert is not None:
        try:
            value = convert(value)
        except Exception as e:  # noqa: BLE001 - an odd answer is a reason, not a crash
            return Reading(None, f"cannot read the answer of {name}: {e}")
    return Reading(value)


def start_recording() -> list[dict[str, Any]]:
    """Keep every raw NVML answer from now on (probes/record.py writes them as a replayable fixture)."""
    global _recording
    _recording = []
    return _recording


def _plain(value: Any) -> Any:
    """A JSON-able copy of an NVML answer: ctypes structures become dicts of their fields."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    fields = getattr(value, "_fields_", None)
    if fields:
        return {f[0]: _plain(getattr(value, f[0])) for f in fields}
    return repr(value)


def _arg_key(arg: Any) -> Any:
    if isinstance(arg, (int, str)):
        return arg
    for i, h in enumerate(_handles):
        if h is arg:
            return f"handle{i}"
    return repr(arg)


_handles: list[Any] = []


def _record(name: str, args: tuple, value: Any, error: tuple[str, str] | None) -> None:
    if name == "nvmlDeviceGetHandleByIndex" and error is None:
        _handles.append(value)
    if _recording is None:
        return
    entry: dict[str, Any] = {"name": name, "args": [_arg_key(a) for a in args]}
    if error:
        entry["error"] = list(error)
    elif name == "nvmlDeviceGetHandleByIndex":
        entry["value"] = f"handle{args[0]}"
    else:
        entry["value"] = _plain(value)
    _recording.append(entry)


def const(name: str, default: Any = None) -> Any:
    """A pynvml constant (NVML_CLOCK_SM, ...) or ``default`` when this binding lacks it."""
    init()
    value = getattr(_nvml, name, default) if _nvml is not None else default
    if _recording is not None and isinstance(value, int):
        constants_used[name] = value
    return value


constants_used: dict[str, int] = {}
