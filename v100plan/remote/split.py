"""A model split into its tensor-parallel shards here, before the upload, and kept in a local cache.

`python -m engine shard SRC DST --tp 2` writes ``shard.json``, ``rank0/`` and ``rank1/`` (each a
loadable model directory with config and tokenizer copied) and checks that the shards reassemble
bit-exactly. The split is cached under the local v100plan home, keyed by the SHA-256 of the
model's files, so a redeploy of the same model splits nothing; the same model always splits into
the same bytes, so the release id stays the same too.

The home is the user's own (v100plan/remote/trusted.py): $V100PLAN_HOME, else
$XDG_CACHE_HOME/v100plan, else ~/.cache/v100plan, made 0700 and refused, with its owner named,
when another user could have put something there. The shards are written 0600 in 0700 folders.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from v100plan.errors import BadInput, EnvironmentProblem
from v100plan.remote import release as rel
from v100plan.remote import trusted

TP = 2  # the bundled engine serves two tensor-parallel ranks
RECORD = ".v100plan-sha256.json"  # in the cached split: its files' SHA-256 as written (hidden: not uploaded)


def home() -> Path:
    """The local v100plan home (made 0700 if absent): $V100PLAN_HOME, else $XDG_CACHE_HOME/v100plan, else
    ~/.cache/v100plan; never a shared temp folder. EnvironmentProblem when it is not the user's own."""
    given = os.environ.get("V100PLAN_HOME")
    d = given or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "v100plan")
    try:
        return Path(trusted.private_dir(d, "v100plan home"))
    except trusted.Untrusted as e:
        raise EnvironmentProblem(
            f"{e}", hint=f"if you did not make it, another user may have: look (`ls -la {d}`), remove it, "
                         "or set V100PLAN_HOME to a folder of your own") from None
    except OSError as e:
        raise EnvironmentProblem(f"the v100plan home {d} cannot be made: {e.strerror or e}",
                                 hint="set V100PLAN_HOME to a folder of your own") from None


def cache_dir(source_digest: str, tp: int = TP) -> Path:
    return home() / "shards" / f"{source_digest}-tp{tp}"


@dataclass(frozen=True)
class Split:
    dir: Path
    files: dict[str, dict[str, Any]]     # {relative path: {sha256, bytes}}: every file that is uploaded
    source_digest: str                   # of the unsplit model's files
    tp: int
    bytes_per_rank: list[int]            # the weights' bytes in each rank's directory
    cached: bool                         # True: the split was already there, nothing was split now
    seconds: float

    def sentence(self) -> str:
        per_rank = ", ".join(f"{b / 1e6:.1f}" for b in self.bytes_per_rank)
        if self.cached:
            return (f"split into {self.tp} shards already ({self.dir}, cached by the model's SHA-256): "
                    f"{per_rank} MB per rank; nothing split")
        return (f"split into {self.tp} shards locally: {per_rank} MB per rank ({self.seconds:.1f} s, "
                f"reassembly checked bit-exactly; cached in {self.dir})")


def cached(source_files: dict[str, dict[str, Any]], tp: int = TP) -> Split | None:
    """The cached split of these model files, or None when there is none or its files are no longer
    what the split wrote (read-only: what --dry-run uses)."""
    digest = rel.model_digest(source_files)
    d = cache_dir(digest, tp)
    if not (d / "shard.json").is_file():
        return None
    try:
        trusted.check_private(d, "cached split")
    except trusted.Untrusted as e:
        raise EnvironmentProblem(str(e), hint=f"remove it (rm -r {d}) if you did not make it; the next deploy "
                                              "splits the model again") from None
    found = _described(d, digest, tp, cached=True, seconds=0.0)
    try:
        recorded = json.loads((d / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return found if recorded == found.files and _copies_match(found.files, source_files, tp) else None


def _copies_match(files: dict[str, dict[str, Any]], source_files: dict[str, dict[str, Any]], tp: int) -> bool:
    """Each rank's copies of the source's own files (config, tokenizer) are byte for byte the source's, by
    SHA-256 against the model given now, and each rank holds exactly the files the split writes."""
    for r in range(tp):
        names = {k.split("/", 1)[1] for k in files if k.startswith(f"rank{r}/")}
        if names - {"model.safetensors", *source_files} or "model.safetensors" not in names:
            return False
        if any(files[f"rank{r}/{n}"]["sha256"] != source_files[n]["sha256"] for n in names - {"model.safetensors"}):
            return False
    return True


def split(model_dir: str | Path, source_files: dict[str, dict[str, Any]], tp: int = TP) -> Split:
    """The model's shards: from the cache, or split now (into a temporary directory renamed into place)."""
    hit = cached(source_files, tp)
    if hit is not None:
        return hit
    digest = rel.model_digest(source_files)
    d = cache_dir(digest, tp)
    trusted.private_dir(d.parent)
    if d.exists():  # a split whose files changed since (or one that never finished): made again
        shutil.rmtree(d)
    tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.", dir=d.parent))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "engine", "shard", str(model_dir), str(tmp / "out"),
                               "--tp", str(tp), "--json"], capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            why = (proc.stderr.strip().splitlines() or ["(no output)"])[-1].removeprefix("Error: ")
            raise BadInput(f"--model {str(model_dir)!r} could not be split into {tp} tensor-parallel shards: {why}",
                           hint=f"check the model locally: python -m engine shard {model_dir} /tmp/shards --tp {tp}")
        out = tmp / "out"
        man = json.loads((out / "shard.json").read_text())
        # The local path the model was read from is not the host's business, and must not make the
        # same model's shards differ: the manifest names it by its files' digest instead.
        man["source"] = f"model files sha256 digest {digest}"
        (out / "shard.json").write_text(json.dumps(man, indent=1, sort_keys=True) + "\n")
        (out / RECORD).write_text(json.dumps(rel.hash_files(out), indent=1, sort_keys=True) + "\n")
        for p in [out, *out.rglob("*")]:  # the user's only, whatever the umask (the host keeps these modes)
            p.chmod(0o700 if p.is_dir() else 0o600)
        try:
            os.rename(out, d)
        except OSError:  # another deploy split the same model meanwhile: theirs is the same bytes
            if not (d / "shard.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _described(d, digest, tp, cached=False, seconds=time.perf_counter() - t0)


def _described(d: Path, digest: str, tp: int, cached: bool, seconds: float) -> Split:
    man = json.loads((d / "shard.json").read_text())
    return Split(dir=d, files=rel.hash_files(d), source_digest=digest, tp=tp,
                 bytes_per_rank=[int(b) for b in man["bytes_per_rank"]], cached=cached, seconds=seconds)


def weight_bytes(source_files: dict[str, dict[str, Any]]) -> int:
    """The unsplit weights' bytes (what a dry run can say before splitting)."""
    return sum(f["bytes"] for name, f in source_files.items() if name.endswith(".safetensors"))
