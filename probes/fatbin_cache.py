"""The architectures a CUDA library carries, read from its file once and cached by the file's SHA-256.

Walking the device code of a 300 MB libnccl costs seconds on every quick probe; the answer only changes
with the file. The cache maps a file's SHA-256 to its architecture list, and a file's (path, size,
mtime) to its SHA-256 so an unchanged file is not even hashed again. It lives in
``$V100PLAN_CACHE_DIR`` or ``$XDG_CACHE_HOME/v100plan`` (default ``~/.cache/v100plan``), one JSON file
written 0600 by an atomic rename; a cache that cannot be read or written is simply not used.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from probes import fatbin

CACHE_NAME = "fatbin-archs.json"
VERSION = 1


def cache_path() -> Path:
    base = os.environ.get("V100PLAN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "v100plan")
    return Path(base) / CACHE_NAME


def sha256_of(path: str | Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _load(p: Path) -> dict:
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError):
        return {"version": VERSION, "by_sha256": {}, "by_stat": {}}
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        return {"version": VERSION, "by_sha256": {}, "by_stat": {}}
    doc.setdefault("by_sha256", {})
    doc.setdefault("by_stat", {})
    return doc


def _save(p: Path, doc: dict) -> None:
    try:
        p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".fatbin-", suffix=".json")
        with os.fdopen(fd, "w") as f:  # mkstemp creates it 0600
            json.dump(doc, f)
        os.replace(tmp, p)
    except OSError:
        pass  # a read-only home: the next probe reads the library again, nothing worse


def archs_in(path: str | Path, read: Callable[[str | Path], list[str]] = fatbin.archs_in) -> tuple[list[str], str]:
    """(the architectures in the library at ``path``, "cached" or "read") through the cache."""
    real = os.path.realpath(path)
    st = os.stat(real)
    stat_key = f"{real}:{st.st_size}:{st.st_mtime_ns}"
    where = cache_path()
    doc = _load(where)
    digest = doc["by_stat"].get(stat_key) or sha256_of(real)
    archs = doc["by_sha256"].get(digest)
    if isinstance(archs, list) and all(isinstance(a, str) for a in archs):
        if doc["by_stat"].get(stat_key) != digest:
            doc["by_stat"][stat_key] = digest
            _save(where, doc)
        return list(archs), "cached"
    archs = read(real)
    doc["by_sha256"][digest] = archs
    doc["by_stat"][stat_key] = digest
    _save(where, doc)
    return archs, "read"
