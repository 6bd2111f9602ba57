"""The test suite's own helpers: the golden-file check and the recorded-pytest-log reader."""

from __future__ import annotations

import pytest

from tests import golden_files
from tests.pytest_log import outcome_counts


def test_a_recorded_pytest_log_is_read_by_its_summary_line():
    assert outcome_counts("....\n9 passed, 15 warnings in 174.01s (0:02:54)\n") == {"passed": 9}
    assert outcome_counts("=== 1 failed, 19 passed, 2 errors in 3.10s ===") == {"failed": 1, "passed": 19, "error": 2}
    with pytest.raises(AssertionError, match="no summary line"):
        outcome_counts("....F\nKeyboardInterrupt\n")


def test_a_golden_file_is_rewritten_only_on_purpose(tmp_path, monkeypatch):
    path = tmp_path / "g" / "table.txt"
    monkeypatch.delenv(golden_files.UPDATE, raising=False)
    with pytest.raises(AssertionError, match="no golden file"):
        golden_files.check(path, "a\n")
    monkeypatch.setenv(golden_files.UPDATE, "1")
    golden_files.check(path, "a\n")
    monkeypatch.delenv(golden_files.UPDATE)
    golden_files.check(path, "a\n")
    with pytest.raises(AssertionError, match=r"(?s)table.txt changed.*-a\n\+b"):
        golden_files.check(path, "b\n")
