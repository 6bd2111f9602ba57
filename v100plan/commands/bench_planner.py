"""`v100plan bench planner`: the planner's own predictions against published batch-1 decode figures.

Reads profiles/published/decode-batch1.json (each figure with its source, build and settings, and
whether it calibrated an engine profile or is held out), plans each configuration, and prints the
error of every point, the median and worst error over the held-out points, and whether every
published figure sits under the planner's ceiling. Exit 1 when a figure is above its ceiling or a
point cannot be planned; the goal (held-out median within 10 %, none beyond 25 %) is reported.
--allreduce-range low|high plans with the low or high end of every allreduce figure a hardware
profile takes from a range (its box 'ranges'), instead of the value used: the sensitivity of the
table to that choice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from v100plan import documents, interval_fit, output
from v100plan import plan_accuracy as accuracy
from v100plan.options import JsonOpt

REPO = Path(__file__).resolve().parent.parent.parent
DataOpt = Annotated[Optional[Path], typer.Option("--data", help="Published figures JSON (default: profiles/published/decode-batch1.json).")]
RangeOpt = Annotated[Optional[str], typer.Option(
    "--allreduce-range", help="Plan with the 'low' or 'high' end of allreduce figures a hardware profile takes from a "
    "range (box 'ranges') instead of the value used: the table's sensitivity to that choice.")]


def _pct(v: float | None) -> str | None:
    return None if v is None else f"{v:+.1%}"


FitOpt = Annotated[bool, typer.Option(
    "--fit-intervals", help="Refit the prediction intervals (profiles/published/intervals.json) on the training points "
    "(decode-batch1.json and interval-training.json; never the held-out set) before planning.")]


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("planner")
    def bench_planner(data: DataOpt = None, allreduce_range: RangeOpt = None, fit_intervals: FitOpt = False,
                      json_out: JsonOpt = False) -> None:
        """The planner against published decode figures: held-out median and worst error, interval coverage, and the
        ceiling check."""
        if allreduce_range is not None and allreduce_range not in accuracy.RANGE_ENDS:
            raise typer.BadParameter(f"use one of {', '.join(accuracy.RANGE_ENDS)}", param_hint="--allreduce-range")
        if fit_intervals:
            fitted = documents.validate(interval_fit.fit(accuracy.evaluate(REPO), REPO), "prediction_intervals")
            interval_fit.INTERVALS.write_text(json.dumps(fitted, indent=2) + "\n")
            output.render(f"prediction intervals refitted: {interval_fit.INTERVALS}", to_stderr=True)
        rows = accuracy.evaluate(REPO, data or accuracy.PUBLISHED, allreduce_range, interval_fit.load())
        doc = documents.validate(accuracy.document(rows, data or accuracy.PUBLISHED, allreduce_range), "planner_accuracy")
        s, goal_met = doc["summary"], doc["summary"]["goal_met"]
        if json_out:
            output.emit_json(doc)
        else:
            table = output.table(
                "planner vs published batch-1 decode (profiles/published/decode-batch1.json)",
                ["point", "role", "engine", "card x n", "strategy", ("published", "right"), ("predicted", "right"),
                 ("p10-p90", "right"), ("ceiling", "right"), ("error", "right"), "inside"],
                [[r.id, r.role, r.engine, f"{r.hardware} x {r.gpus}", r.strategy, f"{r.published_tok_s:.1f}",
                  None if r.predicted_tok_s is None else f"{r.predicted_tok_s:.1f}",
                  None if r.interval is None else f"{r.interval[0]:.1f}-{r.interval[1]:.1f}",
                  None if r.ceiling_tok_s is None else f"{r.ceiling_tok_s:.0f}", _pct(r.error),
                  {True: "yes", False: "NO", None: "—"}[r.covered]] for r in rows],
                caption="error = predicted / published - 1; calibration points set an engine's efficiencies, held-out points never did"
                        + (f"; ranged allreduce figures at their {allreduce_range} end" if allreduce_range else ""),
            )
            output.render(table, to_stderr=False)
            med, worst = s["held_out_median_abs_error"], s["held_out_worst_abs_error"]
            output.render(f"held out: {s['held_out_predicted']} of {s['held_out']} points planned; median |error| "
                          f"{_pct(med)}, worst {_pct(worst)}; goal (median <= {accuracy.GOAL_MEDIAN:.0%}, worst <= {accuracy.GOAL_WORST:.0%}) "
                          f"{'met' if goal_met else 'NOT met'}", to_stderr=False)
            cov = s["coverage"]
            output.render("inside the p10-p90 interval: " + "; ".join(
                f"{role} {c['inside']} of {c['points']} ({c['share']:.0%})" for role, c in cov.items() if c["points"]),
                to_stderr=False)
            st = s["held_out_stand_in"]
            if st["points"]:
                output.render(f"of which predicted by a stand-in calibration (no calibration of their own for that engine, "
                              f"card generation and format): {st['points']}; median |error| {_pct(st['median_abs_error'])}, "
                              f"worst {_pct(st['worst_abs_error'])} ({', '.join(st['ids'])})", to_stderr=False)
            output.render("every published figure under the planner's ceiling: "
                          + ("yes" if not s["over_ceiling"] and not s["no_ceiling"] else
                             f"no (over: {', '.join(s['over_ceiling']) or 'none'}; no ceiling: {', '.join(s['no_ceiling']) or 'none'})"),
                          to_stderr=False)
        if s["over_ceiling"] or s["no_ceiling"] or s["held_out_predicted"] < s["held_out"]:
            raise typer.Exit(1)
