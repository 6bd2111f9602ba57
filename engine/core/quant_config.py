"""A checkpoint's ``quantization_config`` (GPTQ, AWQ 4-bit) as plain data: parsed and checked without torch, so
reading a config.json stays cheap. The packed weights themselves: engine.core.quant."""

from __future__ import annotations

import dataclasses
from typing import Any

GROUP_SIZES = (32, 64, 128, -1)


class QuantError(ValueError):
    """A quantization_config or packed tensor this engine cannot run, naming the setting."""


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    method: str  # "gptq" | "awq"
    bits: int
    group_size: int  # -1: one group over the whole input
    sym: bool
    desc_act: bool
    checkpoint_format: str  # "gptq" (v1) | "gptq_v2" | "awq_gemm"

    @property
    def zero_offset(self) -> int:
        """What the stored zero point lacks: 1 for GPTQ v1 (stored minus one), else 0."""
        return 1 if self.checkpoint_format == "gptq" else 0

    @property
    def format(self) -> str:
        """The name `generate --json` and /health report, e.g. "gptq-int4-g128"."""
        g = "all" if self.group_size == -1 else str(self.group_size)
        return f"{self.method}-int{self.bits}-g{g}"


def parse(raw: dict[str, Any] | None) -> QuantConfig | None:
    """config.json's ``quantization_config`` -> QuantConfig (None: a dense checkpoint); QuantError naming the
    field and what is accepted otherwise."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise QuantError("quantization_config must be an object")
    method = str(raw.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise QuantError(f"quantization_config.quant_method {raw.get('quant_method')!r} is not supported; this engine "
                         f"runs 4-bit gptq and awq checkpoints")
    bits = raw.get("bits", raw.get("w_bit"))
    if bits != 4:
        raise QuantError(f"quantization_config.bits = {bits!r} is not supported: only 4-bit weights are")
    group = raw.get("group_size", raw.get("q_group_size"))
    if group not in GROUP_SIZES:
        raise QuantError(f"quantization_config.group_size = {group!r} is not supported; accepted: 32, 64, 128 or -1")
    if method == "gptq":
        fmt = str(raw.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantError(f"quantization_config.checkpoint_format {fmt!r} is not supported; accepted: gptq, "
                             f"gptq_v2 (other packings, e.g. marlin, are written for other kernels)")
        return QuantConfig("gptq", 4, int(group), bool(raw.get("sym", True)), bool(raw.get("desc_act", False)), fmt)
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantError(f"quantization_config.version {version!r} is not supported; accepted: gemm (AutoAWQ's "
                         f"GEMM packing)")
    if raw.get("zero_point", True) is not True:
        raise QuantError("quantization_config.zero_point = false is not supported: AWQ GEMM stores zero points")
    return QuantConfig("awq", 4, int(group), False, False, "awq_gemm")


def check_inputs(q: QuantConfig, inputs: dict[str, int], world: int = 1) -> None:
    """Refuse a group size that does not divide a matrix's input, or a row-parallel split (o_proj, down) that
    would cut a group: ``inputs`` maps a matrix's name to its input size (row-parallel ones marked "rowwise:")."""
    problems = []
    for label, k in inputs.items():
        name = label.removeprefix("rowwise:")
        if k % 8:
            problems.append(f"{name} has {k} inputs, not a whole number of 8-value words")
        if q.group_size != -1 and k % q.group_size:
            problems.append(f"group_size {q.group_size} does not divide {name}'s {k} inputs")
        elif label.startswith("rowwise:") and world > 1:
            part = k // world
            if q.group_size == -1 or part % q.group_size or part % 8:
                g = "one group over all of them" if q.group_size == -1 else f"groups of {q.group_size}"
                problems.append(f"splitting {name}'s {k} inputs over {world} ranks ({part} each) would cut "
                                f"{g}")
    if problems:
        raise QuantError("quantization_config: " + "; ".join(problems))
