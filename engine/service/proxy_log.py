"""Structured log: one JSON object per line on stderr and in a file (the state directory's
service.log unless --log-file says where), and the most recent lines kept in memory with a
sequence number for GET /control/events?since=N.

One line per request and per rank start/failure/restart, each with the rank
generation and PIDs, so the acceptance suite can reconstruct what happened.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time

ROTATE_BYTES = 32 << 20   # a file beyond this at start is kept as NAME.1 (one old file) and begun afresh
KEEP_EVENTS = 2000        # events /control/events can still hand out


class StructuredLog:
    def __init__(self, path: str | None = None):
        self._file = _open_log(path) if path else None
        self.path = path
        self.seq = 0
        self._recent: collections.deque[dict] = collections.deque(maxlen=KEEP_EVENTS)
        self._lock = threading.Lock()

    def emit(self, event: str, **fields) -> dict:
        with self._lock:
            self.seq += 1
            record = {"ts": round(time.time(), 3), "seq": self.seq, "event": event, **fields}
            line = json.dumps(record, separators=(",", ":"), default=str)
            self._recent.append(json.loads(line))
        print(line, file=sys.stderr, flush=True)
        if self._file is not None:
            self._file.write(line + "\n")
        return record

    def since(self, seq: int) -> list[dict]:
        """The kept events after sequence number `seq` (oldest first)."""
        with self._lock:
            return [e for e in self._recent if e["seq"] > seq]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _open_log(path: str):
    """Append to `path` (0600, never through a symbolic link), moving a file grown past
    ROTATE_BYTES to NAME.1 first."""
    try:
        st = os.lstat(path)
        if st.st_size > ROTATE_BYTES and not os.path.islink(path):
            os.replace(path, path + ".1")
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    return os.fdopen(fd, "a", buffering=1)
