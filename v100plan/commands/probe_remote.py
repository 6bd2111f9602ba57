"""`v100plan probe --host H [H...] | --inventory FILE`: the probes on other hosts, over SSH, in parallel.

One host: its ProbeReport is judged and shown exactly like a local probe. Several: one
progress line per host, results keyed by host, and a fleet summary table; a host that
cannot be probed is listed with its error and never stops the others. ``--max-fail N``
lets up to N hosts fail before the command exits non-zero.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from v100plan import output, probe_judge
from v100plan.errors import ChecksFailed, EnvironmentProblem, NothingMeasured, V100planError

# the summary's columns: (header, judge check names)
SUMMARY_CHECKS = (("variant", ("variant",)), ("read bandwidth", ("read bandwidth",)), ("P2P", ("P2P",)),
                  ("throttle", ("throttle",)), ("kernels", ("NCCL kernels", "torch kernels")))


def _cell(rows: list[probe_judge.Row], checks: tuple[str, ...]) -> str:
    """The worst status among ``checks`` (bandwidth also gets its percentage of the expected figure)."""
    mine = [r for r in rows if r.check in checks]
    if not mine:
        return "—"
    worst = max(mine, key=lambda r: probe_judge.STATUS_ORDER.get(r.status, 0))
    if "read bandwidth" in checks:
        pcts = sorted({m.group(0) for r in mine for m in [re.search(r"\d+%", r.detail)] if m})
        return f"{worst.status} {'/'.join(pcts)}".strip()
    return worst.status


def _variants(report: dict[str, Any]) -> str:
    ids = [c.get("variant_id") or "unknown" for c in report.get("cards") or []]
    return ", ".join(dict.fromkeys(ids)) or "—"


def _judged(report: dict[str, Any]) -> tuple[dict[str, Any], probe_judge.Judgement]:
    from v100plan.commands.probe import hardware_catalogue

    hardware, problems = hardware_catalogue()
    j = probe_judge.judge(report, hardware, catalogue_problems=problems)
    doc = j.report
    doc["verdicts"] = j.to_dict()["rows"]
    return doc, j


def summary_rows(results, judged: dict[str, probe_judge.Judgement]) -> list[tuple]:
    rows = []
    for r in results:
        if r.report is None:
            rows.append((r.host, "down" if r.exit_code == 4 else "error", "—", *(["—"] * len(SUMMARY_CHECKS)),
                         f"{r.wall_s:.1f}", r.error))
            continue
        j = judged[r.host]
        measured = not probe_judge.nothing_measured(r.report)
        status = r.report["overall"] if measured else "nothing measured (no GPU: cases waived)"
        rows.append((r.host, status, len(r.report.get("cards") or []), _variants(r.report),
                     *(_cell(j.rows, c) for _, c in SUMMARY_CHECKS[1:]), f"{r.wall_s:.1f}", ""))
    return rows


def run(hosts: list[str] | None, inventory: str | None, max_fail: int, probe_args: list[str], ssh, remote,
        json_out: bool, out: str | None, quiet: bool) -> None:  # noqa: ANN001
    from v100plan.remote.hosts import collect_hosts
    from v100plan.remote.probe import probe_fleet, worst_exit

    specs = collect_hosts(hosts, inventory)
    if max_fail < 0:
        from v100plan.errors import BadInput

        raise BadInput("--max-fail must be 0 or more", hint="e.g. --max-fail 2 lets two hosts fail")
    output.check_out(out)
    lock = threading.Lock()

    def on_stage(host: str, text: str) -> None:
        if not quiet:
            with lock:
                output.hint(f"[{host}] {text}")

    results = probe_fleet(specs, ssh, remote, probe_args, on_stage=on_stage)
    judged: dict[str, probe_judge.Judgement] = {}
    docs: dict[str, Any] = {}
    for r in results:
        if r.report is not None:
            r.report, judged[r.host] = _judged(r.report)
        docs[r.host] = r.to_dict()
    failed = [r for r in results if r.report is None]
    if len(specs) == 1 and not failed:
        from v100plan.commands.probe import render_verdicts

        doc = results[0].report
        output.write_json(out, doc, indent=1)
        if json_out:
            output.emit_json(doc)
        if not quiet:
            render_verdicts(judged[results[0].host], doc, to_stderr=json_out)
        _exit_for([results[0]], judged, failed, max_fail, worst_exit)
        return
    from profiles.document import stamp

    fleet = {**stamp("fleet_probe", {"hosts": [s.label for s in specs], "inventory": inventory,
                                     "probe_args": list(probe_args)}),
             "hosts": docs, "summary": {"hosts": len(specs), "probed": len(specs) - len(failed),
                                        "failed": [r.host for r in failed],
                                        "wall_s": round(max((r.wall_s for r in results), default=0.0), 3)}}
    output.write_json(out, fleet, indent=1)
    if json_out:
        output.emit_json(fleet)
    if not quiet:
        table = output.table(
            "Fleet", ["host", "status", ("cards", "right"), *(h for h, _ in SUMMARY_CHECKS), ("s", "right"), "error"],
            summary_rows(results, judged),
            caption=f"{len(specs) - len(failed)} of {len(specs)} hosts probed")
        output.render(table, to_stderr=json_out)
    _exit_for(results, judged, failed, max_fail, worst_exit)


def _exit_for(results, judged, failed, max_fail: int, worst_exit) -> None:  # noqa: ANN001
    if len(failed) > max_fail:
        if len(results) == 1:
            r = failed[0]
            err = V100planError(r.error or "the probe failed", r.hint)
            err.exit_code = r.exit_code or 4
            raise err
        code = worst_exit(failed)
        err = EnvironmentProblem(
            f"{len(failed)} host(s) could not be probed (--max-fail {max_fail}): "
            + "; ".join(f"{r.host}: {r.error}" for r in failed[:3]),
            hint="the table above lists each host's error; --max-fail N tolerates N failed hosts")
        err.exit_code = code
        raise err
    ok = [r for r in results if r.report is not None]
    bad = [r.host for r in ok if any(row.status == "failed" for row in judged[r.host].rows)
           or r.report["overall"] == "failed"]
    if bad:
        raise ChecksFailed(f"checks failed on {', '.join(bad[:5])}",
                           hint="the verdict table says which and why; --json has the raw figures")
    if ok and all(probe_judge.nothing_measured(r.report) for r in ok):
        raise NothingMeasured("nothing could be measured on " + ", ".join(r.host for r in ok[:5])
                              + ": no NVIDIA driver there (every GPU case waived)",
                              hint="check `nvidia-smi` on the host")
