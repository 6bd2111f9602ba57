"""The test suite's own helpers: the golden-file check."""

from __future__ import annotations

import pytest

from tests import golden_files


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
