"""`v100plan bench probes`: the bandwidth probe against references measured in the same run,
and the probe's wall time per phase (case)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from profiles.document import SCHEMA_VERSIONS, provenance
from v100plan import documents, output
from v100plan.commands.probe import DurationOpt, FromOpt, OnlyOpt, measure_or_load
from v100plan.errors import NothingMeasured
from v100plan.options import JsonOpt, OutOpt, QuietOpt

QuickOpt = Annotated[bool, typer.Option("--quick/--standard",
                                        help="Quick: a 4-10 s load (until power is steady) and fewer repeats; standard: 30 s load.")]

# The bar: the probe's read kernel reaches at least this share of the best in-run reference.
TARGET_FRACTION = 0.98


def bench_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for card in report["cards"]:
        bw = card.get("bandwidth") or {}
        refs = bw.get("references_gbps") or {}
        read = card.get("read_bw_gbps")
        if read is None or not refs:
            continue
        best_name = max(refs, key=refs.get)
        rows.append({
            "card": card["index"], "name": card["name"], "read_bw_gbps": read, "copy_bw_gbps": card.get("copy_bw_gbps"),
            "implied_bw_gbps": card.get("implied_bw_gbps"), "references_gbps": refs, "best_reference": best_name,
            "read_over_best_reference": round(read / refs[best_name], 4),
            "meets_target": read / refs[best_name] >= TARGET_FRACTION,
        })
    return rows


def register(app: typer.Typer) -> None:
    @app.command("probes")
    def bench_probes(
        quick: QuickOpt = True,
        duration: DurationOpt = None,
        only: OnlyOpt = None,
        from_file: FromOpt = None,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
        out: OutOpt = None,
    ) -> None:
        """The bandwidth probe against references measured in the same run, and the wall time of each case."""
        output.check_out(out)
        report = measure_or_load(quick, None, duration, only, Path(from_file) if from_file else None,
                                 show_progress=not quiet)
        rows = bench_rows(report)
        phases = [{"case": c["key"], "status": c["status"], "duration_s": c["duration_s"]} for c in report["cases"]]
        doc = {"kind": "probe_bench", "schema_version": SCHEMA_VERSIONS["probe_bench"],
               "provenance": provenance({"probe_report": str(from_file) if from_file else "measured now",
                                         "quick": quick, "only": only}),
               "probe_provenance": report["provenance"], "bandwidth": rows, "phases": phases,
               "wall_s": report.get("wall_s"), "target_fraction": TARGET_FRACTION}
        documents.validate(doc, "probe_bench", source="bench probes")
        output.write_json(out, doc)
        if json_out:
            output.emit_json(doc)
        if not quiet:
            table_rows = []
            for r in rows:
                refs = ", ".join(f"{k} {v:.0f}" for k, v in r["references_gbps"].items())
                table_rows.append((r["card"], r["name"], f"{r['read_bw_gbps']:.0f}", f"{r['copy_bw_gbps']:.0f}",
                                   refs, f"{r['read_over_best_reference']:.1%}",
                                   "yes" if r["meets_target"] else "NO", r["implied_bw_gbps"]))
            output.render(output.table(
                "Bandwidth probe vs in-run references (GB/s; copy counts read + write)",
                ["card", "name", ("read", "right"), ("copy", "right"), "references", ("read/best", "right"),
                 f">= {TARGET_FRACTION:.0%}", ("implied", "right")], table_rows), to_stderr=json_out)
            output.render(output.table("Wall time per phase", ["case", "status", ("s", "right")],
                                       [(p["case"], p["status"], f"{p['duration_s']:.2f}") for p in phases],
                                       caption=f"total {report.get('wall_s', 0):.1f} s"), to_stderr=json_out)
        if not rows:
            raise NothingMeasured("no card's bandwidth was measured",
                                  hint="run on a GPU host; `v100plan probe` says which case was waived and why")
