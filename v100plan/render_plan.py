"""Plans and comparisons for people: tables plus the arithmetic of the recommended strategy.

Builds renderables through v100plan.output (the only module importing rich); the
same objects are printed by the CLI and rendered to text by golden tests.
"""

from __future__ import annotations

from typing import Any

from v100plan import output
from v100plan.units import format_tokens, gib


def _num(v: float | None, fmt: str = "{:.1f}") -> str | None:
    return None if v is None else fmt.format(v)


def _seconds(v: float | None) -> str | None:
    """0.9 s stays 0.9 (not "1"); from 10 s on, whole seconds."""
    return None if v is None else (f"{v:.1f}" if v < 10 else f"{v:.0f}")


def _ctx(tokens: int) -> str:
    """Whole K (K = 1024), rounded down so the shown context fits."""
    return format_tokens(tokens) if tokens % 1024 == 0 or tokens < 1024 else f"{tokens // 1024}K"


def _range(iv: list[float] | None, fmt: str = "{:.0f}") -> str | None:
    return None if not iv else f"{fmt.format(iv[0])}-{fmt.format(iv[1])}"


def _interval_lines(s: dict[str, Any]) -> list[str]:
    """The recommended strategy's intervals, for people: what a measurement may give, and from what."""
    if not s.get("decode_tok_s_interval"):
        return []
    lo, hi = s["decode_tok_s_interval"]
    line = f"p10-p90: decode {lo:.1f}-{hi:.1f} tok/s"
    if s.get("prefill_s_interval"):
        a, b = s["prefill_s_interval"]
        line += f", prefill {a:.1f}-{b:.1f} s"
    if s.get("ttft_s_interval"):
        a, b = s["ttft_s_interval"]
        line += f", time to first token {s['ttft_s']:.1f} s ({a:.1f}-{b:.1f})"
    return [line, f"interval from {s['interval_source']}"]


def _speed(v: float | None, ceiling: float | None) -> str | None:
    if v is None:
        return None
    return f"{v:.1f} / {ceiling:.0f}"


def plan_renderables(doc: dict[str, Any]) -> list[Any]:
    """The plan table, then 'why' lines for the recommended strategy, then notes."""
    i = doc["inputs"]
    title = (f"{i['model']} on {i['gpus']} x {i['card']} ({i['hardware']}), engine {i['engine']}, "
             f"context {format_tokens(i['context_tokens'])}, acceptance {i['acceptance']:g} (k={i['draft_tokens']}), "
             f"concurrency {i['concurrency']}")
    rows = []
    for s in doc["strategies"]:
        mark = " *" if s["name"] == doc["recommended"] else ""
        rows.append([
            s["name"] + mark, "yes" if s["fits"] else "no", _ctx(s["max_context"]),
            _num(s["decode_tok_s"]), _range(s.get("decode_tok_s_interval")), _num(s["decode_ceiling_tok_s"]), _num(s["aggregate_tok_s"]), _num(s["round_ms"]),
            _seconds(s["prefill_s"]), f"{gib(s['memory_per_gpu_gb']):.1f}", s["allreduce_path"],
        ])
    table = output.table(
        title,
        ["strategy", "fits", ("max ctx", "right"), ("tok/s", "right"), ("p10-p90", "right"), ("ceiling", "right"), ("aggr.", "right"),
         ("round ms", "right"), ("prefill s", "right"), ("GiB/GPU", "right"), "allreduce"],
        rows,
        caption="* recommended (" + ("best aggregate" if i.get("objective") == "throughput" else "best one-stream decode")
        + "); tok/s: one stream (p10-p90: where a measurement may fall); aggr.: all streams the strategy serves at once; ceiling: 100 % bandwidth, no overhead",
    )
    out: list[Any] = [table]
    out += [f"  {s['name']}: {s['reason']}" for s in doc["strategies"]]
    if doc["recommended"]:
        out.append(f"Why {doc['recommended']}:")
        out += [f"  {line}" for line in doc["why"]]
        best = next(s for s in doc["strategies"] if s["name"] == doc["recommended"])
        out += [f"  {line}" for line in _interval_lines(best)]
    else:
        out.append("No strategy fits." if not any(s["fits"] for s in doc["strategies"]) else
                   "No speeds: the engine profile has no measured efficiencies.")
    nf = doc.get("nearest_fit")
    if nf:
        out.append(f"Nearest configuration that fits: {nf['change']}: {nf['strategy']} with {nf['model']} on "
                   f"{nf['gpus']} x {nf['hardware']} at {_ctx(nf['context_tokens'])}")
    if doc["launch"]:
        L = doc["launch"]
        spec = f", speculative {L['speculative']} x {L['draft_tokens']}" if L.get("draft_tokens") else ""
        kv = f", K/V {L['kv_cache_dtype']}" if L.get("kv_cache_dtype") else ""
        out.append(f"Launch: engine {L['engine']}" + ("" if L.get("bundled", True) else " (external: not bundled)")
                   + f", tp {L['tp']}, replicas {L['replicas']}, allreduce {L['allreduce']}, "
                   f"max context {L['max_context']}, dtype {L['dtype']}{kv}{spec}")
    if doc.get("notes"):
        out.append("Notes:")
        out += [f"  - {n}" for n in doc["notes"]]
    return out


STAND_IN_MARK = "~"  # beside a speed whose engine x generation x format has no calibration of its own


def compare_renderables(doc: dict[str, Any]) -> list[Any]:
    rows = []
    stand_ins = []
    for r in doc["rows"]:
        speed = _speed(r["decode_tok_s"], r["decode_ceiling_tok_s"])
        if speed and r.get("speeds_calibrated") is False:
            speed = STAND_IN_MARK + speed
            stand_ins.append(f"{STAND_IN_MARK} {r['gpus']} x {r['hardware']}: {r['speeds_stand_in']}")
        price = None if r["price_total"] is None else f"{r['price_total']:,.0f} {r['currency']}"
        per = None if r["price_per_decode_tok_s"] is None else f"{r['price_per_decode_tok_s']:,.0f} {r['currency']}"
        rows.append([
            f"{r['gpus']} x {r['hardware']}", r["best_strategy"] or "nothing fits",
            speed, _range(r.get("decode_tok_s_interval")),
            {True: "yes", False: "no", None: None}[r.get("overlaps_best")], _num(r["aggregate_tok_s"]),
            _seconds(r["prefill_s"]), _ctx(r["max_context"]), price, per,
        ])
    i = doc["inputs"]
    table = output.table(
        f"{i['model']}, context {format_tokens(i['context_tokens'])}, engine {i['engine']}",
        ["hardware", "best strategy", ("decode tok/s / ceiling", "right"), ("p10-p90", "right"), "overlaps fastest",
         ("aggregate", "right"), ("prefill s", "right"),
         ("max ctx", "right"), ("price", "right"), ("price per tok/s", "right")],
        rows,
        caption="ranked as listed; overlaps fastest: this box's p10-p90 interval meets the fastest box's (the order may not "
        "hold on real boxes); price per tok/s = price of the cards / one-stream decode tok/s (only where prices are known)"
        + (f"; {STAND_IN_MARK}: not calibrated for this engine, card generation and format (below)" if stand_ins else ""),
    )
    return [table] + stand_ins


def print_all(renderables: list[Any], to_stderr: bool = False) -> None:
    for r in renderables:
        output.render(r, to_stderr=to_stderr)
