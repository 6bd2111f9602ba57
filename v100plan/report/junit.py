"""The acceptance report as JUnit XML, for CI systems that show test results.

One <testsuites>; one <testsuite> per scenario group (functional, fault, load),
always all three so a CI dashboard keeps its columns; one <testcase> per scenario
(classname ``v100plan.accept.<group>``, name = key, time = duration_s).
failed -> <failure>, error -> <error>, waived -> <skipped message=reason>, warned
-> passing with the warning in <system-out>. Counts come from the scenarios
themselves; the verdict, target and partial flag travel as <properties>. A run that
stopped early (Ctrl-C, a phase that failed) adds a <testsuite> "v100plan.accept.run"
whose one <testcase> is an <error> with the reason, so CI never counts it green.
A suite's timestamp is when its first scenario started.
ElementTree escapes text and attributes; characters XML 1.0 cannot carry at all
(NUL, ANSI escapes) become U+FFFD.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Any

GROUPS = ("functional", "fault", "load")
_NOT_XML = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff\ufffe\uffff]")


def _x(value: Any) -> str:
    return _NOT_XML.sub("\ufffd", "" if value is None else str(value))


def _seconds(v: float | None) -> str:
    return f"{v:.3f}" if v is not None else "0"


def _properties(parent: ET.Element, report: dict[str, Any]) -> None:
    props = ET.SubElement(parent, "properties")
    t = report["target"]
    pairs = [("verdict", report["verdict"]), ("verdict_reason", report["verdict_reason"]),
             ("partial", str(report["partial"]).lower()), ("target.mode", t["mode"]),
             ("target.endpoint", t["endpoint"]), ("target.model", t["model"])]
    if report["partial"] and report.get("partial_reason"):
        pairs.append(("partial_reason", report["partial_reason"]))
    if t.get("host"):
        pairs.append(("target.host", t["host"]))
    if t.get("server"):
        pairs.append(("target.server", t["server"]))
    for name, value in pairs:
        ET.SubElement(props, "property", name=name, value=_x(value))


def _evidence_text(s: dict[str, Any]) -> str:
    lines = []
    for e in s["evidence"]:
        head = e["kind"] + (f" HTTP {e['http_status']}" if e.get("http_status") is not None else "")
        lines.append(f"{head}: {e['text']}")
    return "\n".join(lines)


def _testcase(suite: ET.Element, s: dict[str, Any]) -> None:
    case = ET.SubElement(suite, "testcase", classname=f"v100plan.accept.{s['group']}", name=_x(s["key"]),
                         time=_seconds(s["duration_s"]))
    status, reason = s["status"], s["reason"]
    if status == "failed":
        node = ET.SubElement(case, "failure", message=_x(reason or "failed"), type="failed")
        node.text = _x(_evidence_text(s)) or None
    elif status == "error":
        node = ET.SubElement(case, "error", message=_x(reason or "error"), type="error")
        node.text = _x(_evidence_text(s)) or None
    elif status == "waived":
        ET.SubElement(case, "skipped", message=_x(reason or "waived"))
    out = [_x(s["description"])]
    if status == "warned":
        out.append(f"warned: {_x(reason or '')}")
    evidence = _evidence_text(s)
    if evidence and status not in ("failed", "error"):
        out.append(_x(evidence))
    ET.SubElement(case, "system-out").text = "\n".join(out)


def _stopped_early(root: ET.Element, report: dict[str, Any]) -> None:
    """The run itself as one errored test case: it did not finish, whatever its scenarios say."""
    suite = ET.SubElement(root, "testsuite", name="v100plan.accept.run", tests="1", failures="0", errors="1",
                          skipped="0", time=_seconds(report.get("wall_s")),
                          timestamp=_x(report["provenance"]["created_utc"]), hostname=_x(report["provenance"]["host"]))
    _properties(suite, report)
    case = ET.SubElement(suite, "testcase", classname="v100plan.accept.run", name="complete",
                         time=_seconds(report.get("wall_s")))
    ET.SubElement(case, "error", message=_x(report.get("partial_reason") or "the run stopped early"),
                  type="incomplete")


def render_junit(report: dict[str, Any]) -> str:
    """The JUnit XML text (UTF-8 declaration included) for one AcceptanceReport."""
    scenarios = report["scenarios"]
    root = ET.Element("testsuites", name="v100plan accept")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "time": 0.0}
    for group in GROUPS:
        members = [s for s in scenarios if s["group"] == group]
        counts = {
            "tests": len(members),
            "failures": sum(s["status"] == "failed" for s in members),
            "errors": sum(s["status"] == "error" for s in members),
            "skipped": sum(s["status"] == "waived" for s in members),
            "time": sum(s["duration_s"] or 0.0 for s in members),
        }
        for k, v in counts.items():
            totals[k] += v
        started = min((s["started_utc"] for s in members if s.get("started_utc")),
                      default=report["provenance"]["created_utc"])
        suite = ET.SubElement(root, "testsuite", name=f"v100plan.accept.{group}",
                              tests=str(counts["tests"]), failures=str(counts["failures"]),
                              errors=str(counts["errors"]), skipped=str(counts["skipped"]),
                              time=_seconds(counts["time"]), timestamp=_x(started),
                              hostname=_x(report["provenance"]["host"]))
        _properties(suite, report)
        for s in members:
            _testcase(suite, s)
    if report["partial"]:
        _stopped_early(root, report)
        totals["tests"] += 1
        totals["errors"] += 1
    for k in ("tests", "failures", "errors", "skipped"):
        root.set(k, str(totals[k]))
    root.set("time", _seconds(totals["time"]))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
