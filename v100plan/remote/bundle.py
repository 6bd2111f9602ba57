"""The bundle a host gets: probes/, engine/ and profiles/ as one reproducible tar.gz.

The same sources always give the same bytes (sorted entries, zero mtimes and owners,
normalised modes, gzip without a timestamp), so the bundle's SHA-256 names it: a host
that already holds ``bundles/<id>`` gets nothing uploaded.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

from v100plan.errors import EnvironmentProblem

PACKAGES = ("probes", "engine", "profiles")
_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


@dataclass(frozen=True)
class Bundle:
    id: str            # the first 16 hex digits of the tar.gz's SHA-256
    sha256: str
    data: bytes
    files: int

    @property
    def size(self) -> int:
        return len(self.data)


def source_root() -> Path:
    """Where probes/, engine/ and profiles/ are read from: V100PLAN_BUNDLE_ROOT (another checkout, or a
    snapshot taken before a deploy), else next to this installation of v100plan."""
    if os.environ.get("V100PLAN_BUNDLE_ROOT"):
        return Path(os.environ["V100PLAN_BUNDLE_ROOT"]).expanduser().resolve()
    spec = importlib.util.find_spec("engine")
    if spec is None or not spec.origin:
        raise EnvironmentProblem("the engine and probes bundle is not installed next to v100plan",
                                 hint="reinstall v100plan from its source tree: pip install -e '.[deploy]'")
    return Path(spec.origin).resolve().parent.parent


def _files(root: Path) -> list[Path]:
    out = []
    for pkg in PACKAGES:
        base = root / pkg
        if not base.is_dir():
            raise EnvironmentProblem(f"{base} is missing: the bundle needs {', '.join(PACKAGES)}",
                                     hint="reinstall v100plan from its source tree")
        for p in base.rglob("*"):
            rel = p.relative_to(root)
            # caches (__pycache__, .ruff_cache) and hidden files are not the bundle's
            if any(part in _SKIP_DIRS or part.startswith(".") for part in rel.parts) or p.suffix in _SKIP_SUFFIXES:
                continue
            if p.is_file():
                out.append(p)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def build(root: Path | None = None) -> Bundle:
    root = root or source_root()
    files = _files(root)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for p in files:
            info = tarfile.TarInfo(p.relative_to(root).as_posix())
            data = p.read_bytes()
            info.size = len(data)
            info.mode = 0o755 if p.stat().st_mode & 0o111 else 0o644
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    gz = gzip.compress(raw.getvalue(), compresslevel=6, mtime=0)
    digest = hashlib.sha256(gz).hexdigest()
    return Bundle(id=digest[:16], sha256=digest, data=gz, files=len(files))
