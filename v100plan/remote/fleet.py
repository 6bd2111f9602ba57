"""One deploy command over an inventory of hosts (`--inventory FILE`, the probe's format): every host at
once, each in its own thread and SSH session; a host that fails is recorded with its error and exit code
and never stops the others. The command prints one row per host and exits with the worst code."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from v100plan.errors import EXIT_BAD_INPUT, EXIT_ENVIRONMENT, V100planError
from v100plan.remote.probe import MAX_PARALLEL
from v100plan.remote.supervisor import Say, Target, document


@dataclass
class HostOutcome:
    host: str
    doc: dict[str, Any] | None = None      # the command's own document for this host (as with one HOST)
    error: str | None = None
    hint: str | None = None
    exit_code: int = 0
    wall_s: float = 0.0
    started: float = field(default_factory=time.monotonic, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "ok": self.error is None and self.exit_code == 0, "exit_code": self.exit_code,
                "error": self.error, "hint": self.hint, "result": self.doc, "wall_s": round(self.wall_s, 3)}


def run(targets: list[Target], one: Callable[[Target, Say], dict[str, Any]], say: Say) -> list[HostOutcome]:
    """``one(target, say)`` on every target in parallel; results in the inventory's order. ``one`` returns its
    document; an exception is that host's failure (a V100planError with its message, hint and exit code)."""

    def each(target: Target) -> HostOutcome:
        res = HostOutcome(host=target.spec.label)
        try:
            res.doc = one(target, lambda s: say(f"{target.spec.label}: {s}"))
            if res.doc.get("state") == "degraded":
                res.exit_code = 1
        except V100planError as e:
            res.error, res.hint, res.exit_code = e.message, e.hint, e.exit_code
        except Exception as e:  # noqa: BLE001 - one host's surprise never stops the others
            res.error, res.exit_code = f"{type(e).__name__}: {e}", EXIT_ENVIRONMENT
        res.wall_s = time.monotonic() - res.started
        if res.error:
            say(f"{target.spec.label}: failed: {res.error}")
        return res

    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(targets)), thread_name_prefix="fleet") as pool:
        return list(pool.map(each, targets))


def worst_exit(results: list[HostOutcome]) -> int:
    codes = [r.exit_code for r in results if r.exit_code]
    return EXIT_BAD_INPUT if EXIT_BAD_INPUT in codes else max(codes, default=0)


def fleet_document(action: str, inventory: str, results: list[HostOutcome]) -> dict[str, Any]:
    doc = document("fleet_outcome", {"inventory": inventory, "hosts": [r.host for r in results]})
    doc.update({"action": action, "hosts": [r.to_dict() for r in results],
                "failed": [r.host for r in results if r.exit_code], "exit_code": worst_exit(results)})
    return doc


def rows(results: list[HostOutcome], fields: tuple[str, ...]) -> list[tuple[str, ...]]:
    """One row per host: host, ok/failed, then ``fields`` of its document (or the error)."""
    out = []
    for r in results:
        if r.error:
            out.append((r.host, f"failed (exit {r.exit_code})", r.error, *[""] * (len(fields) - 1)))
        else:
            out.append((r.host, "ok" if not r.exit_code else f"exit {r.exit_code}",
                        *[_text((r.doc or {}).get(f)) for f in fields]))
    return out


def _text(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, dict):
        return ", ".join(f"{k} {x}" for k, x in v.items()) or "-"
    return str(v)
