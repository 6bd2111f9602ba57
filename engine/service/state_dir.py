"""The state directory is the service's private ground: its sockets, logs, keys, service.json
(which `supervise stop` reads to find what to signal). Stdlib only.

A directory (or an entry in it) that another user owns, that others may write, or that is a
symbolic link could be another user's trap: serve deleting "stale runs" through a link, or
`supervise stop` killing a PID someone else wrote into service.json. So it is refused, with the
path and what to do; and a PID is signalled only when its start time is the one recorded when
it was ours (a PID reused by another process is left alone).
"""

from __future__ import annotations

import os
import stat

# The entries a serve makes, and the folders among them whose entries are checked too.
_CHECKED_FOLDERS = ("run", "logs")


class StateDirError(Exception):
    """The state directory cannot be trusted; the message names the path and the fix."""


def _check_entry(path: str, uid: int, top: bool = False) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    what = "the state directory" if top else "an entry of the state directory"
    if stat.S_ISLNK(st.st_mode):
        raise StateDirError(f"{what} {path} is a symbolic link: serve never follows links there "
                            f"(remove it, or give --state-dir a directory of your own)")
    if st.st_uid != uid:
        raise StateDirError(f"{what} {path} belongs to uid {st.st_uid}, not to this user (uid {uid}): "
                            f"give --state-dir a directory of your own")
    if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022:
        raise StateDirError(f"{what} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}): "
                            f"anyone could have put files there; check it, then `chmod 700 {path}`")


def check_state_dir(state_dir: str) -> None:
    """Refuse `state_dir` unless it and every entry in it (and in its run/ and logs/) belong to
    this user, are not writable by others, and none is a symbolic link. A missing directory is fine."""
    uid = os.geteuid()
    _check_entry(state_dir, uid, top=True)
    if not os.path.isdir(state_dir):
        return
    for entry in os.scandir(state_dir):
        _check_entry(entry.path, uid)
        if entry.name in _CHECKED_FOLDERS and entry.is_dir(follow_symlinks=False):
            for sub in os.scandir(entry.path):
                _check_entry(sub.path, uid)


def make_state_dir(state_dir: str) -> None:
    """Create (0700) or check the state directory, then make it 0700."""
    check_state_dir(state_dir)
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    check_state_dir(state_dir)  # made by someone else between the check and makedirs: still refused
    os.chmod(state_dir, 0o700)


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (proc(5) field 22), or None when it is gone."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:
            return int(fh.read().rsplit(b") ", 1)[1].split()[22 - 3])
    except (OSError, ValueError, IndexError):
        return None


def is_same_process(pid: int | None, started: int | None) -> bool:
    """True only when `pid` runs now, belongs to this user, and started at `started` (as recorded
    when it was ours): the proof needed before signalling it."""
    if not pid or started is None:
        return False
    try:
        if os.stat(f"/proc/{int(pid)}").st_uid != os.geteuid():
            return False
    except OSError:
        return False
    return start_time(pid) == started
