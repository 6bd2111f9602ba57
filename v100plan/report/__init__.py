"""Renderers of the AcceptanceReport: HTML with inline SVG plots for people, JUnit XML for CI,
and the JSON document itself. They format the document; they compute no verdict or statistic.

``write_reports(report, out_dir)`` validates and writes all three.
"""

from v100plan.report.html import render_html
from v100plan.report.junit import render_junit
from v100plan.report.write import FILES, validate_report, write_reports

__all__ = ["FILES", "render_html", "render_junit", "validate_report", "write_reports"]
