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
