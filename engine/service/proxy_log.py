"""Structured log: one JSON object per line on stderr (and optionally a file).

One line per request and per rank start/failure/restart, each with the rank
generation and PIDs, so the acceptance suite can reconstruct what happened.
"""

from __future__ import annotations

import json
import sys
import time


class StructuredLog:
    def __init__(self, path: str | None = None):
        self._file = open(path, "a", buffering=1) if path else None

    def emit(self, event: str, **fields) -> dict:
        record = {"ts": round(time.time(), 3), "event": event, **fields}
        line = json.dumps(record, separators=(",", ":"), default=str)
        print(line, file=sys.stderr, flush=True)
        if self._file is not None:
            self._file.write(line + "\n")
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
