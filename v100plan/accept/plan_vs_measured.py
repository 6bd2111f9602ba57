"""The plan held against what the acceptance run measured: per figure the prediction (with its interval where the
plan gives one), the measurement, the error and whether the measurement fell inside the interval.

  decode tok/s      one greedy request whose prompt fills the plan's context (or the served one, if smaller) less
                    the tokens it decodes: generated tokens after the first / time from the first to the last
  TTFT              that request's time from sending to its first token (a long prompt's prefill)
  memory per GPU    the engine's ranks after that request: card memory in use (cudaMemGetInfo: total - free) x the
                    rank's share of its card, the largest rank; the bundled engine on a GPU only
  max context       the context the service serves (its /v1/models max_model_len) against the plan's max context

error = (measured - predicted) / predicted. An empty section says why (no plan, no GPU, a figure the server does
not report); nothing here is estimated.
"""

from __future__ import annotations

import random
import time
from typing import Any

DECODE_TOKENS = 64          # tokens the timed request decodes
MIN_PROMPT_TOKENS = 16
FIGURES = (  # key, unit, the plan strategy's field, its interval's field
    ("decode_tok_s", "tok/s", "decode_tok_s", "decode_tok_s_interval"),
    ("ttft_s", "s", "ttft_s", "ttft_s_interval"),
    ("memory_per_gpu_gb", "GB", "memory_per_gpu_gb", None),
    ("max_context", "tokens", "max_context", None),
)


def empty(why: str) -> dict[str, Any]:
    return {"strategy": None, "context_tokens": None, "measured_context_tokens": None, "figures": [], "why": why}


def strategy_of(plan: dict[str, Any], bundled_engine: bool) -> dict[str, Any] | None:
    """The plan's row for what is served: the bundled engine runs two tensor-parallel ranks (tp2); any other
    server the recommended strategy."""
    name = "tp2" if bundled_engine else plan.get("recommended")
    return next((s for s in plan.get("strategies", []) if s.get("name") == name and s.get("fits")), None)


def section(ctx, plan: dict[str, Any] | None, *, gpu: bool | None) -> dict[str, Any]:  # noqa: ANN001 - a Context
    """The report's plan_vs_measured section. ``gpu``: whether the service runs on GPUs (None: not known; the
    bundled engine's /health then says where its ranks run)."""
    if gpu is None and ctx.is_engine:
        gpu = _engine_on_gpu(ctx)
    if plan is None and gpu is False:
        return empty("no GPU: the service runs on CPU, which the planner does not model, so there is no plan to "
                     "hold it against")
    if plan is None:
        return empty("no plan given: nothing to compare (qualify plans when it finds GPUs; accept takes --plan FILE)")
    if gpu is False:
        return empty("the service runs on CPU: the plan predicts GPUs, so its figures are not compared with a CPU's")
    row = strategy_of(plan, ctx.is_engine)
    if row is None:
        return empty(f"the plan has no fitting {'tp2' if ctx.is_engine else 'recommended'} strategy to compare")
    context = int((plan.get("inputs") or {}).get("context_tokens") or 0)
    measured = measure(ctx, context)
    figures = [figure(key, unit, row.get(field), row.get(interval) if interval else None, measured.get(key),
                      measured.get(f"{key}_why"))
               for key, unit, field, interval in FIGURES]
    notes = list(measured.get("notes", []))
    if any(f["figure"] == "decode_tok_s" and f["inside_interval"] is False for f in figures):
        inputs = plan.get("inputs") or {}
        notes.append("decode fell outside the plan's interval: `v100plan calibrate --endpoint "
                     f"{ctx.target.endpoint} --model {inputs.get('model', 'MODEL')} --hardware "
                     f"{inputs.get('hardware', 'HARDWARE')} --out profile.json` measures this service into an engine "
                     "profile, and `v100plan plan --engine profile.json` plans with it")
    if measured.get("context_tokens") and context and measured["context_tokens"] < context:
        notes.append(f"measured at {measured['context_tokens']} positions, the served context, against the plan's "
                     f"{context}: decode and TTFT predictions are for the plan's context")
    return {"strategy": row["name"], "context_tokens": context, "measured_context_tokens": measured.get("context_tokens"),
            "figures": figures, "why": None, "notes": notes}


def figure(key: str, unit: str, predicted: float | None, interval: list[float] | None, measured: float | None,
           measured_why: str | None) -> dict[str, Any]:
    """One row: predicted, interval, measured, error (a fraction), inside the interval (None where either is absent)."""
    err = None
    if predicted and measured is not None:
        err = round((measured - predicted) / predicted, 4)
    inside = None
    if interval and measured is not None:
        inside = interval[0] <= measured <= interval[1]
    why = measured_why if measured is None else None
    if interval is None and measured is not None:
        why = "the plan gives no interval for this figure"
    return {"figure": key, "unit": unit, "predicted": predicted, "interval": list(interval) if interval else None,
            "measured": measured, "error": err, "inside_interval": inside, "why": why}


def measure(ctx, context_tokens: int) -> dict[str, Any]:  # noqa: ANN001 - a Context
    """The timed request and what the engine's /health says after it."""
    out: dict[str, Any] = {"notes": []}
    served = ctx.max_context
    out["max_context"] = served
    if served is None:
        out["max_context_why"] = "the server does not say its context limit (no max_model_len in /v1/models)"
    limit = min(c for c in (context_tokens, served) if c) if (context_tokens or served) else 0
    prompt_len = limit - DECODE_TOKENS - 1
    if prompt_len < MIN_PROMPT_TOKENS:
        why = f"a context of {limit} leaves no room for a timed prompt"
        out["decode_tok_s_why"] = out["ttft_s_why"] = why
        return out
    out["context_tokens"] = prompt_len + DECODE_TOKENS
    # Fresh ids each run (never a prefix the service holds from an earlier run), below the vocabularies' specials.
    rng = random.Random(time.time_ns())
    ids = [rng.randrange(100, 250) for _ in range(prompt_len)]
    body = ctx.payload("", DECODE_TOKENS) | {"prompt": ids, "stream_options": {"include_usage": True}}
    s = ctx.client.stream("/v1/completions", body, timeout_s=3600)
    events = s.token_events()
    if s.status != 200 or not events:
        why = f"the timed request answered {s.status}: {str(s.body)[:200]}" if s.status != 200 else \
            "the timed request streamed no tokens"
        out["decode_tok_s_why"] = out["ttft_s_why"] = why
    else:
        tokens = _completion_tokens(s) or len(events)
        out["ttft_s"] = round(events[0][0], 4)
        span = events[-1][0] - events[0][0]
        if tokens > 1 and span > 0:
            out["decode_tok_s"] = round((tokens - 1) / span, 2)
        else:
            out["decode_tok_s_why"] = "one streamed event: no decode time to divide by"
        out["notes"].append(f"timed request: {prompt_len} prompt tokens, {tokens} generated")
    memory, why = _memory_per_gpu(ctx)
    out["memory_per_gpu_gb"], out["memory_per_gpu_gb_why"] = memory, why
    return out


def _completion_tokens(s) -> int | None:  # noqa: ANN001 - a Stream
    for _, ev in reversed(s.events):
        usage = ev.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            return usage["completion_tokens"]
    return None


def _memory_per_gpu(ctx) -> tuple[float | None, str | None]:  # noqa: ANN001 - a Context
    if not ctx.is_engine:
        return None, "the server does not report its GPU memory (the bundled engine's /health does)"
    h = ctx.client.get("/health", timeout_s=10)
    ranks = (h.body.get("decode") or {}) if h.ok and isinstance(h.body, dict) else {}
    used = [m["card_used_bytes"] * m.get("card_share", 1.0) for d in ranks.values() if isinstance(d, dict)
            for m in [d.get("memory")] if isinstance(m, dict) and m.get("card_used_bytes")]
    if not used:
        return None, "the ranks report no card memory (they run on CPU)"
    return round(max(used) / 1e9, 3), None


def _engine_on_gpu(ctx) -> bool | None:  # noqa: ANN001 - a Context
    """Whether the bundled engine's ranks run on GPUs, from the devices its keyed /health names (None: not said)."""
    h = ctx.client.get("/health", timeout_s=10)
    ranks = (h.body.get("decode") or {}) if h.ok and isinstance(h.body, dict) else {}
    devices = [d.get("device") for d in ranks.values() if isinstance(d, dict) and d.get("device")]
    return any(str(d).startswith("cuda") for d in devices) if devices else None
