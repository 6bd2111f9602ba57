"""Deploy's own plan: with no --plan, the probe of the host and the model's config are planned here (as `v100plan
plan --hardware PROBE --model DIR` would) and the bundled engine runs that plan's tp2 settings: its dtype, K/V
cache type, speculation and draft tokens, allreduce path. The context is left to the engine's own default (the
model's native context, bounded by what fits the cards, which /health reports) unless --max-context is given.
Where the plan cannot be run (a config the planner cannot read, no tp2 strategy that fits), the probe's settings
stand and the sentence says why."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from v100plan.errors import V100planError
from v100plan.remote import release as rel

PLAN_CONTEXT = 4096  # the context the settings are chosen at; the served one is the engine's memory-bounded default


def settings_for_host(report: dict[str, Any], model_dir: str | Path, host: str, port: int, fault_injection: bool,
                      max_context: int | None) -> tuple[rel.EngineSettings, str, dict[str, Any] | None]:
    """(settings, the sentence saying what was chosen and why, where they came from: the plan's origin or None)."""
    settings, why = rel.settings_from_probe(report, host, port, fault_injection, max_context)
    if settings.device != "cuda":
        return settings, why, None
    from v100plan.planning import plan_document

    source = f"deploy's own plan for {host}"
    try:
        doc = plan_document(report, None, str(model_dir), "v100plan", str(PLAN_CONTEXT), None, 1, "latency")
        planned, said = rel.settings_from_plan(doc, source, port, fault_injection)
    except V100planError as e:
        return settings, f"{why} (not planned: {e.message})", None
    served = str(max_context) if max_context else "the engine's default (native, bounded by memory)"
    said = said.replace(f"context limit {planned.max_context}", f"context limit {served}")
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
    return replace(planned, max_context=max_context), said, rel.plan_origin(doc, source, digest)
