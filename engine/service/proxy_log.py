"""Structured log: one JSON object per line in a file (the state directory's service.log unless
--log-file says where) and on stderr, and the most recent lines kept in memory with a sequence
number for GET /control/events?since=N.

One line per request and per rank start/failure/restart, each with the rank
generation and PIDs, so the acceptance suite can reconstruct what happened.

The file is written first, by the caller; stderr by a thread of its own from a bounded queue, so a
stderr nobody reads (a full pipe) or a broken one (its reader gone) never blocks or fails the
service: lines it cannot take are dropped for stderr only, and once a write to it fails, stderr is
pointed at /dev/null for good (every other writer too) and the file says so (``stderr_lost``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import sys
import threading
import time

ROTATE_BYTES = 32 << 20   # a file beyond this at start is kept as NAME.1 (one old file) and begun afresh
KEEP_EVENTS = 2000        # events /control/events can still hand out
STDERR_BACKLOG = 1000     # lines waiting for stderr; beyond, a line goes to the file only


class StructuredLog:
    def __init__(self, path: str | None = None):
        self._file = _open_log(path) if path else None
        self.path = path
        self.seq = 0
        self._recent: collections.deque[dict] = collections.deque(maxlen=KEEP_EVENTS)
        self._lock = threading.Lock()
        self._stderr: queue.Queue[str | None] = queue.Queue(STDERR_BACKLOG)
        self.stderr_dropped = 0
        self._writer = threading.Thread(target=self._write_stderr, name="log-stderr", daemon=True)
        self._writer.start()

    def emit(self, event: str, **fields) -> dict:
        with self._lock:
            self.seq += 1
            record = {"ts": round(time.time(), 3), "seq": self.seq, "event": event, **fields}
            line = json.dumps(record, separators=(",", ":"), default=str)
            self._recent.append(json.loads(line))
            self._to_file(line)
        try:
            self._stderr.put_nowait(line)
        except queue.Full:
            self.stderr_dropped += 1
        return record

    def _to_file(self, line: str) -> None:
        if self._file is not None:
            try:
                self._file.write(line + "\n")
            except (OSError, ValueError):
                pass  # a full disk loses this line; the service goes on (stderr may still have it)

    def _write_stderr(self) -> None:
        while True:
            line = self._stderr.get()
            if line is None:
                return
            try:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
            except (OSError, ValueError) as exc:
                _stderr_to_devnull()
                with self._lock:
                    self.seq += 1
                    self._to_file(json.dumps({"ts": round(time.time(), 3), "seq": self.seq, "event": "stderr_lost",
                                              "reason": f"{type(exc).__name__}: {exc}",
                                              "hint": "every line goes on to this file only"},
                                             separators=(",", ":")))
                return

    def since(self, seq: int) -> list[dict]:
        """The kept events after sequence number `seq` (oldest first)."""
        with self._lock:
            return [e for e in self._recent if e["seq"] > seq]

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self._stderr.put_nowait(None)
        self._writer.join(1.0)  # the last lines (serve_exit) reach stderr unless it is stuck
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _stderr_to_devnull() -> None:
    """stderr's reader is gone: point descriptor 2 at /dev/null, so no later write of anyone in this process
    (uvicorn's logging, a warning, the interpreter at exit) fails or raises SIGPIPE-like errors."""
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()  # what was held in its buffer now goes to /dev/null


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
