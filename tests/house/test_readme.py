"""What README.md tells a newcomer holds: the serve help it points at shows every default, and its
curl example asks for the greedy answer that is "the same noise on every machine"."""

from __future__ import annotations

import argparse
import json
import re

from engine.service.serve_config import add_serve_arguments
from tests.conftest import REPO

README = (REPO / "README.md").read_text()


def test_serve_help_shows_every_options_default():
    parser = argparse.ArgumentParser(prog="serve")
    add_serve_arguments(parser)
    missing = [a.option_strings[0] for a in parser._actions
               if a.option_strings and a.dest != "help" and not a.required
               and "default" not in (a.help or "") % {"default": a.default}]
    assert missing == [], f"`python -m engine serve --help` shows no default for {missing}"
    assert "python -m engine serve --help` lists every option with its default" in " ".join(README.split())


def test_the_curl_example_is_greedy():
    bodies = re.findall(r"curl .*?-d '(\{.*?\})'", README, re.DOTALL)
    assert bodies, "the README has no curl example"
    for body in bodies:
        assert json.loads(body).get("temperature") == 0, body


def test_the_quick_start_installs_the_deploy_extra_and_says_ci_needs_root():
    quick = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"pip install -q -e '\.\[[a-z,]*deploy[a-z,]*\]'", quick)
    assert "root" in quick and "apt-get" in quick


def test_the_readme_screenshot_is_a_real_qualify_report():
    """docs/acceptance-report.png is drawn from a real qualify run's report (tests/accept/test_report_chromium.py
    renders SCREENSHOT_REPORT), not from the renderer's made-up sample."""
    from tests.accept.test_report_chromium import SCREENSHOT, SCREENSHOT_REPORT

    assert "](docs/acceptance-report.png)" in README and SCREENSHOT.stat().st_size > 100_000
    report = json.loads((REPO / "tests" / "fixtures" / "acceptance" / SCREENSHOT_REPORT).read_text())
    assert report["provenance"]["tool"] == "v100plan" and report["provenance"]["host"] != "renderer-fixture"
    assert [p["name"] for p in report["phases"]] == ["probe", "plan", "start", "accept", "report"]
    assert report["target"]["mode"] == "local" and len(report["scenarios"]) >= 20
