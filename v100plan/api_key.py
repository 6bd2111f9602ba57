"""An API key read from a file (never from the command line, where `ps` and shell history would show it)."""

from __future__ import annotations

import stat
from pathlib import Path

from v100plan.errors import BadInput


def read_api_key(path: Path) -> str:
    """The key from a file; a group- or world-readable file is refused (it would leak the key)."""
    try:
        st = path.stat()
        text = path.read_text().strip()
    except OSError as e:
        raise BadInput(f"--api-key-file {str(path)!r}: {e.strerror or e}", hint="give a readable file holding the key") \
            from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise BadInput(f"--api-key-file {str(path)!r} is readable by other users (mode {stat.S_IMODE(st.st_mode):o})",
                       hint=f"chmod 600 {path}")
    if not text:
        raise BadInput(f"--api-key-file {str(path)!r} is empty", hint="put the API key on the file's first line")
    return text
