"""The state directory is the service's private ground: its sockets, logs, keys, service.json
(which `supervise stop` reads to find what to signal). Stdlib only.

A directory (or an entry in it, or a folder above it) that another user owns, that others may
write, or that is a symbolic link could be another user's trap: serve deleting "stale runs"
through a link, writing its logs into their folder, or `supervise stop` killing a PID someone
else wrote into service.json. So it is refused, with the path and what to do.

A process is ours only when it proves it: every process a service starts (supervisord, the
proxy, the fork server, the ranks) carries the state directory's secret (``identity``, 0600,
made once) in its environment, and /proc/PID/environ is readable only by the process's owner
and root. A start time (/proc/PID/stat, readable by anyone) is only a second check against a
PID reused by another process of ours.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat

# The entries a serve makes, and the folders among them whose entries are checked too.
_CHECKED_FOLDERS = ("run", "logs")
# The environment variable that carries the state directory's secret into each process of the service.
ID_ENV = "V100PLAN_SERVICE_ID"
ID_FILE = "identity"


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


def _check_parent(path: str, state_dir: str, uid: int) -> None:
    """A folder above the state directory: no link, owned by this user or root, and writable by nobody
    else, except a sticky folder of root's or this user's (/tmp): there only an entry's owner may rename
    or remove it, and the entry below is checked in turn."""
    st = os.lstat(path)
    where = f"{path}, above the state directory {state_dir},"
    if stat.S_ISLNK(st.st_mode):
        raise StateDirError(f"{where} is a symbolic link: no link is followed on the way to a state directory "
                            f"(give --state-dir its real path: `realpath {state_dir}`)")
    if st.st_uid not in (uid, 0):
        raise StateDirError(f"{where} belongs to uid {st.st_uid}, neither this user (uid {uid}) nor root: its "
                            f"owner could swap the state directory for their own; give --state-dir a path "
                            f"through folders of your own")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise StateDirError(f"{where} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}): they "
                            f"could swap the state directory; give --state-dir a path through folders only you "
                            f"can write, or `chmod go-w {path}`")


def check_state_dir(state_dir: str) -> None:
    """Refuse `state_dir` unless every folder above it belongs to this user or root and is not writable by
    others (sticky /tmp aside), none is a link, and it and every entry in it (and in its run/ and logs/)
    belong to this user, are not writable by others, and none is a symbolic link. A missing directory
    (or missing folders above it) is fine: what exists is checked."""
    uid = os.geteuid()
    state_dir = os.path.abspath(state_dir)  # never resolved: a link on the way is what is refused
    parts = state_dir.split(os.sep)[1:-1]
    for i in range(len(parts)):
        above = os.sep + os.sep.join(parts[: i + 1])
        try:
            _check_parent(above, state_dir, uid)
        except FileNotFoundError:
            break
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


def service_id(state_dir: str, create: bool = True) -> str | None:
    """The state directory's secret (``identity``, 0600, 32 hex digits), made on first use when `create`;
    None when there is none (nothing started from this state directory can prove it is ours)."""
    path = os.path.join(state_dir, ID_FILE)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            if not create:
                return None
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                continue  # made a moment ago by another start: read that one
            with os.fdopen(fd, "w") as fh:
                token = secrets.token_hex(16)
                fh.write(token)
            return token
        with os.fdopen(fd) as fh:
            st = os.fstat(fh.fileno())
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise StateDirError(f"{path} is not this user's private file (uid {st.st_uid}, mode "
                                    f"{stat.S_IMODE(st.st_mode):04o}): remove it and start again")
            token = fh.read().strip()
        if len(token) == 32 and all(c in "0123456789abcdef" for c in token):
            return token
        raise StateDirError(f"{path} does not hold a service identity: remove it and start again")
    raise StateDirError(f"{path} appeared and vanished while it was read: start again")


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (proc(5) field 22), or None when it is gone."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:
            return int(fh.read().rsplit(b") ", 1)[1].split()[22 - 3])
    except (OSError, ValueError, IndexError):
        return None


def carries_id(pid: int | None, token: str | None) -> bool:
    """True only when `pid` runs as this user and its environment (/proc/PID/environ: readable by its
    owner and root alone) holds the state directory's secret `token`: a process we started."""
    if not pid or not token:
        return False
    try:
        if os.stat(f"/proc/{int(pid)}").st_uid != os.geteuid():
            return False
        with open(f"/proc/{int(pid)}/environ", "rb") as fh:
            env = fh.read()
    except (OSError, ValueError):
        return False
    want = f"{ID_ENV}=".encode()
    for item in env.split(b"\0"):
        if item.startswith(want) and hmac.compare_digest(item[len(want):], token.encode()):
            return True
    return False


def is_same_process(pid: int | None, started: int | None, token: str | None) -> bool:
    """True only when `pid` runs now, belongs to this user, carries the state directory's secret and
    started at `started` (as recorded when it was ours): the proof needed before signalling it."""
    if not pid or started is None:
        return False
    return carries_id(pid, token) and start_time(pid) == started
