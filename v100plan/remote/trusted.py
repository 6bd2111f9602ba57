"""Folders v100plan trusts: its own only. One helper for the operator's machine and the host.

A cache, state or model folder is used only when it is the user's own and nobody else can write
to it or swap it: the folder is owned by the user and not group- or world-writable (PostgreSQL
refuses a data directory it does not own for the same reason), and every folder above it (and
every symbolic link on the way) is owned by the user or root and not writable by others, unless
it is sticky (/tmp: others cannot rename or delete what is ours there). A folder made here is
made 0700. What another user could have planted is refused with the folder and its owner named.

Stdlib only: v100plan imports it, and the host agent (v100plan/remote/agent.py) is sent with this
file's source in front of its own, so the same rules hold on both sides.
"""

import os
import stat


class Untrusted(Exception):
    """A folder another user could have made or could change: ``str()`` names it, its owner and why."""


def _owner(uid):
    try:
        import pwd

        return "%s (uid %d)" % (pwd.getpwuid(uid).pw_name, uid)
    except (ImportError, KeyError):
        return "uid %d" % uid


def _check_parent(path, st, me):
    if st.st_uid not in (me, 0):
        raise Untrusted("%s, above it, is owned by %s, not by you (%s) or root: they can swap what lies under it"
                        % (path, _owner(st.st_uid), _owner(me)))
    if stat.S_ISLNK(st.st_mode):
        return
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise Untrusted("%s, above it, is writable by other users (mode %o) and not sticky: they can swap what "
                        "lies under it" % (path, stat.S_IMODE(st.st_mode)))


def check_private(path, what="folder"):
    """Raise Untrusted unless ``path`` (an existing folder) and the folders above it are the user's own
    (see the module's docstring). Returns the absolute path."""
    me = os.geteuid()
    path = os.path.abspath(os.path.expanduser(path))
    for p in (path, os.path.realpath(path)):
        parts = p.split(os.sep)
        for i in range(2, len(parts)):
            above = os.sep.join(parts[:i]) or os.sep
            _check_parent(above, os.lstat(above), me)
    if os.path.islink(path):
        _check_parent(path, os.lstat(path), me)
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted("the %s %s is not a folder" % (what, path))
    if st.st_uid != me:
        raise Untrusted("the %s %s is owned by %s, not by you (%s): v100plan trusts only folders of your own"
                        % (what, path, _owner(st.st_uid), _owner(me)))
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Untrusted("the %s %s is writable by other users (mode %o): v100plan trusts only folders nobody "
                        "else can write" % (what, path, stat.S_IMODE(st.st_mode)))
    return path


def private_dir(path, what="folder"):
    """``path`` made (0700, with any missing folder above it) if absent, then checked (check_private)."""
    path = os.path.abspath(os.path.expanduser(path))
    missing = []
    p = path
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        missing.append(p)
        p = os.path.dirname(p)
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass  # made meanwhile (by whom, the check says)
    return check_private(path, what)
