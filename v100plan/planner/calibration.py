"""Which calibration a plan's speeds come from, and the fixed chain of stand-ins where there is none.

An engine profile is calibrated per card generation and weight format (``by_generation``, its
``weight_bw_fraction_by_format`` tables) on published figures. For an engine x generation x format
with no calibration of its own the planner still gives speeds, through this chain, in this order:

1. the engine's own figures for that generation: the format's figure, else its family's
   (``family:gguf``), else the generation's default (a *format* stand-in where the generation has a
   per-format table that lacks the format);
2. the engine's generation-free figures (``efficiency``), where the profile has them: the profile
   itself names the generations they were calibrated on (``calibrated_generations``) or the figure
   they copy (llama.cpp: its Ada figures); on any other generation they are a *generation* stand-in;
3. the engine's **nearest calibrated generation**, by compute capability (Volta 7.0, Turing 7.5,
   Ampere 8.0, Ada 8.9, Hopper 9.0, Blackwell 10.0; a tie goes to the newer generation), through steps 1-2
   there: a kernel built for one generation runs on its neighbours with the same memory-bound
   structure, and the closer the capability the closer the hardware features it may use;
4. the engine profile's named sibling (``stand_in_engine``, with its reason and source), through the
   same chain: for an engine with no calibration that fits, another engine of the same kind
   (SGLang -> vLLM: both PyTorch, CUDA graphs, paged attention).

Nothing here is fitted: the order is fixed before any held-out figure judges it
(docs/planner-accuracy.md). Every stand-in is a note in the plan and a machine-readable record
(``Speeds.stand_in``, the plan document's ``speeds``), and ``compare`` marks such speeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from v100plan.planner import kernel_model
from v100plan.planner.inputs import Card, Engine, Sourced

# Compute capability of each card generation (NVIDIA CUDA C++ Programming Guide, "Compute Capabilities":
# Volta 7.0, Turing 7.5, Ampere 8.0 (A100; 8.6 for the GeForce/RTX parts), Ada 8.9, Hopper 9.0, Blackwell 10.0).
COMPUTE_CAPABILITY = {"pascal": 6.0, "volta": 7.0, "turing": 7.5, "ampere": 8.0, "ada": 8.9, "hopper": 9.0, "blackwell": 10.0}


@dataclass(frozen=True)
class Speeds:
    """The efficiencies a decode round uses, where they come from, and what stood in (None: calibrated)."""

    weight: Sourced
    kv: Sourced
    overhead: Sourced
    per_layer: Sourced
    engine: Engine                     # the engine whose figures these are (the sibling, where it stood in)
    notes: tuple[str, ...] = ()
    stand_in: dict[str, Any] | None = None
    missing: tuple[str, ...] = field(default=())

    @property
    def complete(self) -> bool:
        return not self.missing

    def record(self, engine_id: str, generation: str, fmt: str) -> dict[str, Any]:
        """The plan document's ``speeds`` object: what was asked for, whether it is calibrated, what stood in."""
        return {"engine": engine_id, "generation": generation or None, "format": fmt,
                "calibrated": self.complete and self.stand_in is None,
                "stand_in": self.stand_in if self.complete else None,
                "missing": list(self.missing)}


def _missing(fw: Sourced, fk: Sourced, oh: Sourced) -> tuple[str, ...]:
    return tuple(n for n, v in (("weight_bw_fraction", fw), ("kv_bw_fraction", fk), ("round_overhead_ms", oh))
                 if v.value is None)


def own(engine: Engine, fmt: str, family: str, generation: str, tp: int) -> Speeds:
    """Steps 1-2: the engine's own figures for ``generation`` (Engine.fractions), with what stood in."""
    fw, fk, oh, notes = engine.fractions(fmt, family, generation, tp)
    per_layer = engine.per_layer_overhead(generation)
    g = engine.by_generation.get(generation)
    stand_in = None
    if g is not None:
        by_fmt = g.get("weight_bw_fraction_by_format", {})
        if by_fmt and fmt not in by_fmt:
            used = f"family:{family}" if family and f"family:{family}" in by_fmt else "default"
            stand_in = {"kind": "format", "engine": engine.id, "generation": generation, "format": used,
                        "why": f"{engine.id} on {generation} is calibrated for {', '.join(sorted(k for k in by_fmt if ':' not in k))}, "
                               f"not {fmt}"}
    else:
        if engine.weight_bw_fraction_by_format and fmt not in engine.weight_bw_fraction_by_format:
            stand_in = {"kind": "format", "engine": engine.id, "generation": None, "format": "default",
                        "why": f"{engine.id} is calibrated for {', '.join(sorted(engine.weight_bw_fraction_by_format))}, not {fmt}"}
        if generation not in engine.generic_generations and fw.value is not None:
            stand_in = {"kind": "generation", "engine": engine.id,
                        "generation": ", ".join(engine.generic_generations) or None,
                        "format": fmt if fmt in engine.weight_bw_fraction_by_format else "default",
                        "why": f"{engine.id}'s generation-free figures stand in on {generation or 'an unknown generation'}: "
                               + fw.source}
    return Speeds(fw, fk, oh, per_layer, engine, tuple(notes), stand_in, _missing(fw, fk, oh))


def nearest_generation(engine: Engine, generation: str, fmt: str, family: str) -> str | None:
    """The calibrated generation of ``engine`` closest in compute capability to ``generation`` whose figures
    give a decode speed (a tie goes to the newer one); None where the generation or every candidate is unknown."""
    if generation not in COMPUTE_CAPABILITY:
        return None
    here = COMPUTE_CAPABILITY[generation]
    usable = [g for g in engine.by_generation if g != generation and g in COMPUTE_CAPABILITY
              and own(engine, fmt, family, g, 1).complete]
    if not usable:
        return None
    return min(usable, key=lambda g: (abs(COMPUTE_CAPABILITY[g] - here), -COMPUTE_CAPABILITY[g]))


def resolve(engine: Engine, fmt: str, family: str, generation: str, tp: int, _seen: tuple[str, ...] = (),
            card: Card | None = None, kv_dtype: str = "") -> Speeds:
    """The whole chain (module docstring): the first step that gives a weight fraction, KV fraction and
    round overhead. Where none does, the engine's own (incomplete) figures come back: the plan gives the
    ceiling only, and says so. An engine with a model of its own kernels (kernel_model.py) uses it on a
    generation it has no recording on, before any stand-in."""
    if (card is not None and generation not in engine.by_generation and generation not in engine.generic_generations
            and kernel_model.applies(engine, card)):
        ref_gen = engine.kernel_model["reference"]["generation"]
        ref = own(engine, fmt, family, ref_gen, tp)
        if ref.complete:
            fw, fk, oh, note = kernel_model.speeds(engine, card, ref.weight, ref.kv, ref.overhead, family, kv_dtype)
            stand_in = {"kind": "kernel_model", "engine": engine.id, "generation": ref_gen, "format": _format_used(engine, ref_gen, fmt, family),
                        "why": f"{engine.id} has no recording on {generation} cards: a model of its own kernels "
                               f"(its {ref_gen} fractions, capped by {card.id}'s ALU throughput; overhead by SM clock)"}
            return Speeds(fw, fk, oh, ref.per_layer, engine, (note,) + ref.notes, stand_in, ())
    mine = own(engine, fmt, family, generation, tp)
    if mine.complete:
        return mine
    near = nearest_generation(engine, generation, fmt, family)
    if near is not None:
        there = own(engine, fmt, family, near, tp)
        stand_in = {"kind": "nearest_generation", "engine": engine.id, "generation": near,
                    "format": _format_used(engine, near, fmt, family),
                    "why": f"{engine.id} has no calibration for {generation} cards; {near} is its nearest calibrated "
                           f"generation (compute capability {COMPUTE_CAPABILITY[near]:g} vs {COMPUTE_CAPABILITY[generation]:g})"}
        note = (f"speeds not calibrated: engine {engine.id} has no {generation} calibration; its {near} figures stand in "
                f"(nearest calibrated generation by compute capability; weight {_g(there.weight.value)}, "
                f"KV {_g(there.kv.value)}, overhead {_g(there.overhead.value)} ms)")
        return Speeds(there.weight, there.kv, there.overhead, there.per_layer, engine,
                      (note,) + there.notes, stand_in, ())
    sib = engine.stand_in_engine
    if sib is not None and sib.id not in _seen + (engine.id,):
        theirs = resolve(sib, fmt, family, generation, tp, _seen + (engine.id,), card=card, kv_dtype=kv_dtype)
        if theirs.complete:
            inner = theirs.stand_in or {}
            stand_in = {"kind": "sibling_engine", "engine": sib.id,
                        "generation": inner.get("generation", generation) if inner else generation,
                        "format": inner.get("format", fmt) if inner else fmt,
                        "why": f"{engine.id} has no calibration that gives speeds; {sib.id} stands in: "
                               f"{engine.stand_in_engine_source}"}
            if inner:
                stand_in["sibling_stand_in"] = inner
            note = (f"speeds not calibrated: engine {engine.id} has no calibration; engine {sib.id}'s figures stand in "
                    f"(its sibling: {engine.stand_in_engine_source})")
            return Speeds(theirs.weight, theirs.kv, theirs.overhead, theirs.per_layer, sib,
                          (note,) + theirs.notes, stand_in, ())
    return mine


def _format_used(engine: Engine, generation: str, fmt: str, family: str) -> str:
    """The key of the weight figure used on ``generation``: the format, its family ('family:gguf'), or 'default'
    (the generation's one figure, whatever format it was calibrated on)."""
    by_fmt = (engine.by_generation.get(generation) or {}).get("weight_bw_fraction_by_format", {})
    if fmt in by_fmt:
        return fmt
    return f"family:{family}" if family and f"family:{family}" in by_fmt else "default"


def stand_in_line(record: dict[str, Any]) -> str | None:
    """One line for people: which calibration stood in (engine, generation, format), and that it is not calibrated."""
    s = record.get("stand_in")
    if not s:
        return None
    gen = s.get("generation") or "generation-free"
    return (f"speeds NOT calibrated for {record['engine']} on {record['generation'] or 'this card'} with {record['format']} "
            f"weights: {s['engine']}'s {gen} {s['format']} figures stand in ({_KIND_WORDS[s['kind']]})")


_KIND_WORDS = {
    "format": "another weight format's figure of the same generation",
    "generation": "the engine's figures calibrated on another generation",
    "nearest_generation": "the engine's nearest calibrated generation",
    "sibling_engine": "a sibling engine of the same kind",
    "kernel_model": "a model of the engine's own kernels, uncalibrated on this generation",
}


def _g(v: float | None) -> str:
    return "none" if v is None else f"{v:g}"
