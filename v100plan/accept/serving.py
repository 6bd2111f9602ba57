"""What the service under test speculates with, as the service itself says it: the ``speculation`` block
in its keyed /health where the engine reports one, else its /metrics (``v100plan_spec_draft_tokens_total``
grows with a greedy request only when the ranks draft), else the launch settings the suite was given
(``Target.engine["speculative"]``: qualify knows the flags it served with)."""

from __future__ import annotations

import re
from typing import Any

from v100plan.accept.context import PROMPTS

SPEC_DRAFTS = "v100plan_spec_draft_tokens_total"
SPEC_ACCEPTED = "v100plan_spec_accepted_tokens_total"


def _counter(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def spec_counters(ctx: Any) -> tuple[float, float] | None:
    """(drafted, accepted) from the service's /metrics; None when /metrics does not say (another make,
    no key, an engine without speculation counters)."""
    a = ctx.client.get("/metrics", timeout_s=10)
    if a.status != 200 or not isinstance(a.body, str):
        return None
    drafted, accepted = _counter(a.body, SPEC_DRAFTS), _counter(a.body, SPEC_ACCEPTED)
    return None if drafted is None or accepted is None else (drafted, accepted)


def health_block(ctx: Any) -> dict | None:
    """/health's ``speculation`` block (settings and the acceptance rate so far), when the engine has one."""
    h = ctx.health(timeout_s=5)
    block = h.body.get("speculation") if h.status == 200 and isinstance(h.body, dict) else None
    return block if isinstance(block, dict) else None


def _block_says(block: dict) -> bool | None:
    """On or off from a speculative block, whichever way it names it; None when it does not say."""
    if isinstance(block.get("enabled"), bool):
        return block["enabled"]
    for key in ("method", "mode", "speculative"):
        if isinstance(block.get(key), str):
            return block[key] not in ("off", "none", "")
    k = block.get("draft_tokens")
    return k > 0 if isinstance(k, int) else None


def speculation(ctx: Any) -> dict:
    """Whether the ranks speculate: {"on": True | False | None (unknown), "source", "draft_tokens": K or None},
    found once per run (ctx.shared)."""
    if "speculation" in ctx.shared:
        return ctx.shared["speculation"]
    given = (ctx.target.engine or {}).get("speculative")
    found: dict = {"on": None, "source": "unknown", "draft_tokens": None}
    block = health_block(ctx) if ctx.is_engine else None
    if block is not None and _block_says(block) is not None:
        k = block.get("draft_tokens")
        found = {"on": _block_says(block), "source": "/health speculation", "health": block,
                 "draft_tokens": k if isinstance(k, int) else None}
    elif ctx.is_engine and (before := spec_counters(ctx)) is not None:
        a = ctx.client.post("/v1/completions", ctx.payload(PROMPTS["begin"], 8))
        after = spec_counters(ctx)
        if a.ok and after is not None and after[0] >= before[0]:
            found = {"on": after[0] > before[0], "source": f"/metrics {SPEC_DRAFTS} over one greedy request",
                     "draft_tokens": None}
    if isinstance(given, dict) and found["on"] is not False:
        k = given.get("draft_tokens")
        found = {**found, "on": True if found["on"] is None else found["on"],
                 "draft_tokens": found["draft_tokens"] or (k if isinstance(k, int) else None),
                 "source": found["source"] if found["on"] else "the launch settings"}
    ctx.shared["speculation"] = found
    return found


def served_draft_tokens(ctx: Any) -> int | None:
    """Drafts per round the service speculates with: 0 when it does not, None when on but the count is unknown."""
    found = speculation(ctx)
    if found["on"] is None or found["on"] is False:
        return 0
    return found["draft_tokens"]
