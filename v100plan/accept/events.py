"""Where the suite reads the engine's structured events (rank_failure with its cause, rank
starts, the exit at the restart cap), without any flag on the engine's side:

1. the service log where the engine writes it by default (the state directory's service.log,
   or what the supervisor captured of its stderr) when the suite can read that directory
   (`--state-dir`, `qualify`, `--host`);
2. else the engine's keyed GET /control/events?since=N (mounted with its fault control).

Neither: the cause is not checked, and the report says which flag or path would have given it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Mark:
    """Where the events stood before an injection: the log's last line, or the endpoint's sequence."""

    source: str                       # "log" | "endpoint" | "none"
    line: str | None = None
    seq: int = 0
    proxy_pid: int | None = None


MISSING = ("no event source: the service log is not readable here (give --state-dir DIR of the engine, "
           "whose DIR/service.log it writes by default) and GET /control/events does not answer "
           "(`v100plan deploy --enable-fault-injection`, or `serve --enable-fault-injection` by hand; with the API "
           "key)")


class Events:
    def __init__(self, ctx: Any):
        self.ctx = ctx

    def _log(self) -> str:
        read = self.ctx.target.read_service_log
        return (read() or "") if read else ""

    def _endpoint(self, since: int) -> dict | None:
        a = self.ctx.client.get(f"/control/events?since={int(since)}", timeout_s=10)
        return a.body if a.status == 200 and isinstance(a.body, dict) and "events" in a.body else None

    def mark(self) -> Mark:
        log = self._log()
        if log:
            lines = log.splitlines()
            return Mark("log", line=lines[-1] if lines else None)
        got = self._endpoint(1 << 62)
        if got is not None:
            return Mark("endpoint", seq=int(got.get("last_seq") or 0), proxy_pid=got.get("proxy_pid"))
        return Mark("none")

    def after(self, mark: Mark) -> list[dict] | None:
        """The events written after `mark`; None when no source can be read."""
        if mark.source == "log":
            return events_after(self._log(), mark.line)
        if mark.source == "endpoint":
            got = self._endpoint(mark.seq)
            if got is not None and got.get("proxy_pid") != mark.proxy_pid:
                got = self._endpoint(0)  # a new proxy: its sequence began afresh, every event is new
            return None if got is None else [e for e in got["events"] if isinstance(e, dict)]
        log = self._log()  # the source may have appeared since (a first write)
        return events_after(log, None) if log else None


def events_after(log: str, mark: str | None) -> list[dict]:
    """The service log's structured events written after the line `mark` (the last line before the
    injection). The log may be a tail of a longer file (a remote host's), so the mark is found by its
    text, not by an offset; when it has scrolled out of the tail, every event in the tail counts."""
    lines = log.splitlines()
    if mark is not None and mark in lines:
        lines = lines[len(lines) - lines[::-1].index(mark):]
    events = []
    for line in lines:
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events
