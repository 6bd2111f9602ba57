"""The decode kernels' tuning tables as data: one JSON file per card family (``hopper.json``, ...), written by the
benches (``python -m engine.bench.gemv --write-table``, ``python -m engine.bench.int4 --write-table``), read by
``load`` once when the decoder is built (engine.core.runner.Decoder) and made the active table the kernels read.

A table holds, per product shape, the block sizes each kernel launches with: ``gemv`` (the plain one-row GEMV, "NxK"
-> [BLOCK_N, BLOCK_K, num_warps]) and ``gemv_default``, ``gemv_configs`` (what the bench sweeps), ``prologue`` (the
GEMVs with a norm or SiLU prologue, "norm:NxK"), ``fp16_silu`` (SiLU + down in fp16), ``int4`` (the packed GEMV,
"norm:NxK" -> [BLOCK_N, BLOCK_K, num_warps, split, stages, form]) and ``attention`` (null: the attention kernel's own
defaults, engine.kernels.decode.launch_config). A card whose family has no file gets DEFAULT_FAMILY's table and
says so (``Table.note``, reported in the decoder's info and so in /health). Stdlib only; reads no environment.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

DIR = Path(__file__).resolve().parent
FAMILIES = {7: "volta", 8: "ampere", 9: "hopper", 10: "blackwell", 12: "blackwell"}  # by compute capability major
DEFAULT_FAMILY = "hopper"  # the only family measured so far (an H200)
OVERRIDE_ENV = "V100PLAN_ENGINE_TUNING"  # a table file to use instead (read by the decoder, when it is built)


@dataclasses.dataclass(frozen=True)
class Table:
    family: str
    source: str  # the file it came from
    note: str | None  # why this card runs another family's table, if it does
    gemv: dict
    gemv_default: tuple
    gemv_configs: tuple
    prologue: dict
    fp16_silu: tuple
    int4: dict
    attention: tuple | None

    def info(self) -> dict:
        """What the decoder reports (/health): the family, the file, and the note when it stands in."""
        return {"family": self.family, "source": self.source, "note": self.note}


def _shape_key(key: str) -> tuple:
    name, _, shape = key.rpartition(":")
    n, k = (int(v) for v in shape.split("x"))
    return (name, n, k) if name else (n, k)


def parse(raw: dict, source: str, note: str | None = None) -> Table:
    """A table from its JSON document; ValueError naming the file when a field is malformed."""
    try:
        return Table(
            family=str(raw.get("family", "?")), source=source, note=note,
            gemv={_shape_key(k): tuple(int(x) for x in v) for k, v in raw.get("gemv", {}).items()},
            gemv_default=tuple(int(x) for x in raw["gemv_default"]),
            gemv_configs=tuple(tuple(int(x) for x in c) for c in raw.get("gemv_configs", [])),
            prologue={_shape_key(k): tuple(int(x) for x in v) for k, v in raw.get("prologue", {}).items()},
            fp16_silu=tuple(int(x) for x in raw["fp16_silu"]),
            int4={_shape_key(k): tuple(int(x) for x in v) for k, v in raw.get("int4", {}).items()},
            attention=tuple(int(x) for x in raw["attention"]) if raw.get("attention") else None)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"tuning table {source}: malformed ({type(e).__name__}: {e})") from None


def family_for(capability: tuple[int, int] | None) -> str | None:
    """The card family of a compute capability (None: a CPU, or a card of no known family)."""
    return None if capability is None else FAMILIES.get(int(capability[0]))


def read(path: Path | str, note: str | None = None) -> Table:
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"tuning table {path}: cannot be read ({e})") from None
    return parse(raw, str(path), note)


def load(capability: tuple[int, int] | None, path: str | None = None) -> Table:
    """The table for a card of ``capability`` (None: CPU): ``path`` when given, else its family's file, else
    DEFAULT_FAMILY's with a note saying it stands in."""
    if path:
        return read(path)
    family = family_for(capability)
    if family is not None and (DIR / f"{family}.json").exists():
        return read(DIR / f"{family}.json")
    where = "CPU" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
    return read(DIR / f"{DEFAULT_FAMILY}.json",
                note=f"no tuning table for {where}" + (f" ({family})" if family else "") +
                f": the {DEFAULT_FAMILY} table stands in (measured on another card)")


_ACTIVE: list[Table] = []


def active() -> Table:
    """The table the kernels launch with: the one the last decoder built made active, else DEFAULT_FAMILY's."""
    if not _ACTIVE:
        _ACTIVE.append(read(DIR / f"{DEFAULT_FAMILY}.json"))
    return _ACTIVE[0]


def use(table: Table) -> Table:
    """Make ``table`` the active one (the decoder does, once, when it is built)."""
    _ACTIVE[:] = [table]
    return table


def write(path: Path | str, section: str, entries: dict, **fields) -> dict:
    """Merge a bench's winners into a table file (made from DEFAULT_FAMILY's when it does not exist yet):
    ``entries`` ("NxK" or "name:NxK" -> blocks) into ``section``; other top-level ``fields`` set as given."""
    path = Path(path)
    base = path if path.exists() else DIR / f"{DEFAULT_FAMILY}.json"
    doc = json.loads(base.read_text())
    doc.setdefault(section, {}).update({k: list(v) for k, v in entries.items()})
    doc.update(fields)
    parse(doc, str(path))  # refuse to write what the loader would not read
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc
