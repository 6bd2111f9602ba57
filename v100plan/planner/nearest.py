"""When nothing fits: the nearest configuration that does.

Tried in order, first that fits wins: the same cards at the largest context any
strategy fits; two cards instead of one; another weight format of the same
model at the target context (smallest weights first).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable


def nearest_fit(hardware, model, engine, target, alternatives, plan_fn: Callable) -> dict[str, Any] | None:
    tries: list[tuple[str, Any, Any, Any]] = []
    if target.gpus < 2:
        tries.append(("two cards instead of one", replace(hardware, gpus=2), model, replace(target, gpus=2)))
    for alt in sorted(alternatives, key=lambda m: m.weights_total_gb):
        if alt.id != model.id and alt.family == model.family:
            tries.append((f"the {alt.format} weights ({alt.weights_total_gb:g} GB)", hardware, alt, target))
    for label, hw, m, t in tries:
        p = plan_fn(hw, m, engine, t)
        fitting = [s for s in p.strategies if s.fits]
        if fitting:
            best = p.recommended or fitting[0].name
            return {"change": label, "hardware": hw.origin, "gpus": t.gpus, "model": m.id, "strategy": best,
                    "context_tokens": t.context_tokens}
    # Shorter context on the same cards: the largest max_context among strategies the cards can run.
    p = plan_fn(hardware, model, engine, replace(target, context_tokens=1))
    runnable = [s for s in p.strategies if s.fits]
    if runnable:
        best = max(runnable, key=lambda s: s.max_context)
        if best.max_context > 0:
            # At that context, recommend as the planner would (several strategies may fit there).
            again = plan_fn(hardware, model, engine, replace(target, context_tokens=best.max_context))
            return {"change": f"a context of at most {best.max_context:,} tokens", "hardware": hardware.origin,
                    "gpus": target.gpus, "model": model.id, "strategy": again.recommended or best.name,
                    "context_tokens": best.max_context}
    return None
