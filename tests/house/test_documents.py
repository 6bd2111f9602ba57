"""Document reading: schema errors name the file and JSON path, another major version is refused with
both versions named, and every document kind the CLI emits has a schema that accepts it."""

from __future__ import annotations

import json

import pytest

from profiles.document import SCHEMA_VERSIONS
from v100plan import documents
from v100plan.errors import DocumentError


def test_every_kind_has_a_schema():
    import profiles

    for kind in SCHEMA_VERSIONS:
        assert profiles.schema_path(kind).exists(), kind


def test_wrong_major_names_both_versions(tmp_path):
    p = tmp_path / "probe.json"
    p.write_text(json.dumps({"kind": "probe_report", "schema_version": "9.0"}))
    with pytest.raises(DocumentError) as e:
        documents.load(p, "probe_report")
    assert "9.0" in e.value.message and SCHEMA_VERSIONS["probe_report"] in e.value.message
    assert e.value.json_path == "$.schema_version" and str(p) in e.value.message


def test_not_json_and_missing_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DocumentError, match="not valid JSON"):
        documents.load(bad, "plan")
    with pytest.raises(DocumentError, match="file not found"):
        documents.load(tmp_path / "absent.json", "plan")


def test_compare_json_is_a_valid_comparison_document(cli):
    doc = cli.json("compare", "--model", "qwen3.8-27b-nvfp4", "--context", "186K", "v100-pg500-216x2", "rtx4090-48g")
    assert doc["kind"] == "comparison" and doc["schema_version"] == SCHEMA_VERSIONS["comparison"]
    documents.validate(doc, "comparison")
    broken = {**doc, "rows": [{**doc["rows"][0], "decode_tok_s": "fast"}]}
    found = documents.problems(broken, "comparison")
    assert found and found[0][0] == "$.rows[0].decode_tok_s"
