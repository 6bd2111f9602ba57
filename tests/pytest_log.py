"""A recorded pytest run read by its outcome counts (the run's summary line), not by grepping its text."""

from __future__ import annotations

import re

# "9 passed, 14 warnings in 190.55s (0:03:10)" or "==== 1 failed, 2 passed in 3.1s ===="
_SUMMARY = re.compile(r"^=*\s*((?:\d+ [a-z]+(?:, )?)+) in [\d.]+s\b.*$", re.MULTILINE)
_OUTCOMES = ("passed", "failed", "error", "errors", "skipped", "xfailed", "xpassed", "deselected")


def outcome_counts(text: str) -> dict[str, int]:
    """{outcome: count} from the last summary line of a pytest console log, warnings left out.

    Raises AssertionError when the log has no summary line (a run cut short says nothing)."""
    found = _SUMMARY.findall(text)
    assert found, "the recorded pytest log has no summary line: the run did not finish"
    counts: dict[str, int] = {}
    for part in found[-1].split(", "):
        n, word = part.split(" ", 1)
        if word in _OUTCOMES:
            counts["error" if word == "errors" else word] = int(n)
    return counts
