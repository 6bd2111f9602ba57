"""An acceptance report scrubbed of secrets, written (JSON, HTML, JUnit) and summed up on stderr."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from v100plan import output
from v100plan.errors import EnvironmentProblem
from v100plan.qualify.phases import accept_status
from v100plan.qualify.progress import Progress


def scrub(doc: Any, secrets: list[str]) -> Any:
    """Replace every secret's text anywhere in the document (a server may echo one in an error)."""
    secrets = [s for s in secrets if s and len(s) >= 4]
    if isinstance(doc, dict):
        return {k: scrub(v, secrets) for k, v in doc.items()}
    if isinstance(doc, list):
        return [scrub(v, secrets) for v in doc]
    if isinstance(doc, str):
        for s in secrets:
            doc = doc.replace(s, "[redacted]")
    return doc


def env_secrets() -> list[str]:
    """Values of environment variables that look like credentials: never allowed into a report."""
    words = ("KEY", "TOKEN", "SECRET", "PASSWORD")
    return [v for k, v in os.environ.items() if any(w in k.upper() for w in words) and len(v) >= 8]


def write_and_summarize(report: dict, out: Path, secrets: list[str], json_out: bool) -> dict[str, Path]:
    """Write report.json, report.html and junit.xml (secrets scrubbed); the verdict and paths on stderr."""
    from v100plan.report.write import write_reports

    report = scrub(report, secrets + env_secrets())
    paths = write_reports(report, out)
    if json_out:
        output.emit_json(report)
    s = report["summary"]
    output.hint(f"verdict: {report['verdict'].upper()}: {report['verdict_reason']}")
    output.hint(f"scenarios: {s['passed']} passed, {s['warned']} warned, {s['failed']} failed, "
                f"{s['waived']} waived, {s['error']} error")
    if report.get("load"):
        ld = report["load"]
        lat = ld["latency_s"]
        output.hint(f"load: {ld['requests']} requests from {ld['clients']} clients in {ld['wall_s']:.1f} s; "
                    f"outcomes {ld['outcomes']}; latency p50 {lat.get('p50')} s, p99 {lat.get('p99')} s; "
                    f"served decode {ld['served_decode_tok_s']} tok/s")
    for kind, p in paths.items():
        output.hint(f"{kind:>5}: {p}")
    return paths


def accept_report(target, opts, plan_doc: dict | None, probe_doc: dict | None, *, inputs: dict,  # noqa: ANN001
                  show: bool) -> dict:
    """Run the acceptance suite against a target and assemble its report (one `accept` phase)."""
    from v100plan.accept.runner import assemble, run_acceptance

    t0 = time.monotonic()
    with Progress(enabled=show) as progress:
        try:
            result = run_acceptance(target, opts, plan=plan_doc, probe=probe_doc, progress=progress)
        except ConnectionError as e:
            raise EnvironmentProblem(f"cannot accept {target.endpoint}: {e}",
                                     "check that the service runs and the URL and API key are right") from None
    wall = time.monotonic() - t0
    phases = [{"name": "accept", "status": accept_status(result),
               "wall_s": round(wall, 3), "detail": f"{len(result['scenarios'])} scenarios"}]
    return assemble(result, phases=phases, probe=probe_doc, plan=plan_doc, inputs=inputs, wall_s=wall)
