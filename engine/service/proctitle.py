"""Process titles, so `ps` and `top` tell the proxy, the fork server and rank 0 from rank 1
(a forked rank keeps its fork server's command line otherwise). Stdlib only, Linux only:

- the thread name (prctl PR_SET_NAME, 15 bytes; `ps -o comm`, `top`);
- the command line `ps` shows, rewritten in place: the kernel reads it from the process's own
  argument area (/proc/self/stat's arg_start..arg_end), which the process may overwrite through
  /proc/self/mem; the title is cut to that area's length (never beyond it, so the environment
  that follows is left alone).

Elsewhere, or when either step is refused, the title stays as it was: never an error.
"""

from __future__ import annotations

import ctypes

_PR_SET_NAME = 15


def set_title(title: str, short: str) -> bool:
    """`title` for ps's command line, `short` (<= 15 bytes) for the thread name. True when the
    command line was rewritten."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        prctl(_PR_SET_NAME, ctypes.c_char_p(short.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b") ", 1)[1].split()
        # proc(5) fields 48 and 49 (arg_start, arg_end); after the comm, fields[0] is field 3.
        start, end = int(fields[48 - 3]), int(fields[49 - 3])
    except (OSError, IndexError, ValueError):
        return False
    size = end - start
    if size <= 1:
        return False
    data = title.encode(errors="replace")[:size - 1]
    try:
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(data + b"\0" * (size - len(data)))
    except OSError:
        return False
    return True
