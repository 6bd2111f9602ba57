"""The bundled engine's batched decode step, as a ratio to its one-sequence step (the profile's ``batched_step``).

With ``serve --max-concurrency`` above 1 the engine decodes every running sequence in one batched step
(Model.decode_batch, replayed from CUDA graphs per row bucket), even for one running request. That step runs the
attention and Gated DeltaNet kernels' forms for rows but one product per layer over the rows (not the
one-sequence step's fused GEMVs), so even one row costs more than the one-sequence step, and each further row
adds its own K/V, state and share of the products (docs/engine-speed.md, 2026-12-06). The planner prices a round
of C sequences as its own one-sequence round (weights once, one sequence's K/V and recurrent state) times the
measured step ratio

    r(C, ctx) = the batched step's ms for C sequences / the one-sequence step's ms, of the same run.

In C: linear interpolation between the measured counts; outside them the line through the nearest two
(past 16: extrapolated, said).

In context, rows lo < hi (past the largest row, the largest two), t = log2(ctx / lo) / log2(hi / lo):

    r(C, ctx) = r_lo(C) + t x d(C),     d(c) = r_hi(c) - r_lo(c) at the counts both rows measured,

d linear in C through those counts (and beyond them on the line through the nearest two): with a long row
measured at C = 1 and 4 only, d(C) = d(1) + (C - 1) x (d(4) - d(1)) / 3, a fixed part the batched step pays at that
context whatever its rows plus a part per further row (each row's K/V read). At a measured point it gives the
measured ratio. At or below the smallest row: that row's ratios; between rows: interpolated; past the largest:
t > 1, extrapolated. A family with one row (bf16 and int4 today: 4K only) uses its ratios at every context, said
(likely optimistic beyond it: each further row reads its own K/V, which grows with the context).

Speculating sequences are not batched (``in_turn``): each takes its own round in turn, so a round of C is C
one-sequence rounds: per request the one-sequence round's tok/s / C, aggregate that round's tok/s.

``how`` is "measured" only at a measured (C, context), "extrapolated" where C or the context lies outside what
was measured, else "interpolated".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from v100plan.planner.inputs import BatchedStep, BatchedStepRow
from v100plan.units import format_tokens

_RANK = {"measured": 0, "interpolated": 1, "extrapolated": 2}


@dataclass(frozen=True)
class StepRatio:
    value: float   # the batched step's time over the one-sequence round's
    how: str       # "measured" | "interpolated" | "extrapolated"
    basis: str     # how it was obtained, in words
    source: str    # the measurement's source
    family: str    # the weight family whose figures were used
    kind: str = "batched"  # "batched": one step for every sequence; "in_turn": each sequence's own round in turn


SPECULATIVE_SOURCE = ("engine/service/rank_batch_spec.py: with --max-concurrency > 1 each speculating sequence runs "
                      "its own eager round (draft + verify), one slot after another, not the batched step")


def in_turn(concurrency: int) -> StepRatio:
    """Speculating sequences (MTP): C one-sequence rounds one after another. The one-sequence round priced is the
    service's graph round; the eager per-slot round's extra cost is not measured, so this is an upper bound."""
    return StepRatio(float(concurrency), "in turn", f"{concurrency} speculative one-sequence rounds one after another "
                     "(not batched); the eager per-slot round's extra cost is not measured: an upper bound",
                     SPECULATIVE_SOURCE, "", kind="in_turn")


def _worst(*hows: str) -> str:
    return max(hows, key=_RANK.__getitem__)


def _line(points: dict[int, float], x: int) -> tuple[float, str, str]:
    """(value at x, how, words): piecewise linear through ``points``, the nearest two's line outside them."""
    xs = sorted(points)
    if x in points:
        return points[x], "measured", f"C = {x} measured"
    if len(xs) == 1:
        return points[xs[0]], "extrapolated", f"C = {x}: only C = {xs[0]} measured, held"
    if x < xs[0]:
        a, b = xs[0], xs[1]
    elif x > xs[-1]:
        a, b = xs[-2], xs[-1]
    else:
        a = max(c for c in xs if c < x)
        b = min(c for c in xs if c > x)
    value = points[a] + (points[b] - points[a]) * (x - a) / (b - a)
    if xs[0] < x < xs[-1]:
        return value, "interpolated", f"C = {x} interpolated linearly between C = {a} and {b}"
    return value, "extrapolated", f"C = {x} extrapolated linearly from C = {a} and {b} (beyond the measured C)"


def step_ratio(table: BatchedStep, fmt: str, concurrency: int, context_tokens: int) -> StepRatio | None:
    """The step ratio for ``concurrency`` sequences of ``fmt`` weights at ``context_tokens`` (module docstring);
    None when the table has no family for the format."""
    fam = table.family_for(fmt)
    if fam is None:
        return None
    rows = fam.rows
    lo: BatchedStepRow = rows[0]
    r_lo, how_c, words_c = _line(lo.ratios(), concurrency)
    if context_tokens <= lo.context_tokens or len(rows) == 1:
        at = format_tokens(lo.context_tokens)
        if context_tokens == lo.context_tokens:
            return StepRatio(r_lo, how_c, f"{fam.name} at {at}: {words_c}", table.source, fam.name)
        if context_tokens < lo.context_tokens:
            why = f"context {format_tokens(context_tokens)} at or below {at}: the {at} ratio held"
        else:
            why = (f"only {at} measured for {fam.name}: its {at} ratio held at {format_tokens(context_tokens)} "
                   "(each further row reads its own K/V, which grows with context: likely optimistic)")
        return StepRatio(r_lo, "extrapolated", f"{fam.name}: {words_c} at {at}; {why}", table.source, fam.name)
    hi_i = next((i for i, r in enumerate(rows) if r.context_tokens >= context_tokens), len(rows) - 1)
    hi_i = max(hi_i, 1)
    lo, hi = rows[hi_i - 1], rows[hi_i]
    lo_ratios, hi_ratios = lo.ratios(), hi.ratios()
    if context_tokens == hi.context_tokens and concurrency in hi_ratios:
        return StepRatio(hi_ratios[concurrency], "measured",
                         f"{fam.name} at {format_tokens(hi.context_tokens)}: C = {concurrency} measured",
                         table.source, fam.name)
    r_lo, how_lo, words_lo = _line(lo_ratios, concurrency)
    common = {c: hi_ratios[c] - lo_ratios[c] for c in hi_ratios if c in lo_ratios}
    d, how_d, _ = _line(common, concurrency)
    t = math.log2(context_tokens / lo.context_tokens) / math.log2(hi.context_tokens / lo.context_tokens)
    how_t = "extrapolated" if t > 1 else "interpolated"
    cs = sorted(common)
    d_words = (f"d(C) = {common[cs[0]]:.3f} + (C - {cs[0]}) x ({common[cs[-1]]:.3f} - {common[cs[0]]:.3f}) / "
               f"{cs[-1] - cs[0]}" if len(cs) >= 2 else f"d = {common[cs[0]]:.3f} (one count in both rows)")
    lo_t, hi_t = format_tokens(lo.context_tokens), format_tokens(hi.context_tokens)
    where = ("beyond" if t > 1 else "between") + f" the {lo_t} and {hi_t} rows"
    basis = (f"{fam.name}: context {format_tokens(context_tokens)} {where}, linear in log2(context) (t = {t:.3f}): "
             f"r = r{lo_t}(C) + t x d(C), r{lo_t}({concurrency}) = {r_lo:.3f} ({words_lo}), {d_words} "
             f"(the {hi_t} increment: a fixed part plus a part per row, counts {', '.join(map(str, cs))} measured in both)")
    return StepRatio(r_lo + t * d, _worst(how_lo, how_d, how_t), basis, table.source, fam.name)
