"""`plan`, `compare` and `profiles` through the real CLI: the JSON contract, golden renderings, bad input.

Golden files live in tests/golden/; refresh them on purpose with
    V100PLAN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/planner/test_cli_plan.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import golden_files
from tests.paths import GOLDEN, REPO
from v100plan import documents

PROBES = "tests/fixtures/probes"  # relative on purpose: the path appears in golden renderings


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(REPO)

GOLDEN_CASES = {
    "plan-default": ["plan"],
    "plan-v100-16gb-nothing-fits": ["plan", "--hardware", "v100-pcie-16gb", "--gpus", "1"],
    "plan-probe-nvlink-hot-card": ["plan", "--hardware", f"{PROBES}/facts-sxm2-pair-nvlink-hot-card1.json", "--context", "8K",
                                   "--acceptance", "0.745"],
    "plan-h200-llama8b": ["plan", "--hardware", "h200", "--gpus", "2", "--model", "llama3.1-8b-fp16", "--context", "32K"],
    "compare-boxes": ["compare", "v100-pg500-216x2", "v100-sxm2-32gbx2", "rtx4090-48g", "h200"],
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_rendering(cli, name):
    r = cli(*GOLDEN_CASES[name])
    assert r.exit_code == (1 if "nothing-fits" in name else 0), r.stderr  # 1: no strategy fits
    golden_files.check(GOLDEN / f"{name}.txt", r.stdout)


def test_plan_with_no_arguments_is_the_bundled_default(cli):
    r = cli("plan")
    assert r.exit_code == 0, r.stderr
    assert "qwen3.8-27b-groupwise-int on 2 x v100-pg500-216" in r.stdout and "engine v100plan" in r.stdout
    assert "Why tp2" in r.stdout and "python -m engine serve" in r.stdout


def test_plan_json_is_one_valid_plan_document(cli):
    r = cli("plan", "--context", "186K", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)  # the whole of stdout is one document
    documents.validate(doc, "plan")
    assert doc["kind"] == "plan" and doc["schema_version"] == "1.0"
    assert doc["inputs"]["context_tokens"] == 186 * 1024
    assert [s["name"] for s in doc["strategies"]] == ["single", "replicas", "layer_split", "tp2"]
    for s in doc["strategies"]:
        for key in ("fits", "max_context", "decode_tok_s", "aggregate_tok_s", "decode_ceiling_tok_s", "round_ms", "prefill_s",
                    "memory_per_gpu_gb", "allreduce_path", "reason"):
            assert key in s
    assert doc["recommended"] == "tp2"
    launch = {k: v for k, v in doc["launch"].items() if k != "commands"}
    assert launch == {"engine": "v100plan", "strategy": "tp2", "tp": 2, "replicas": 1, "gpus": 2,
                      "allreduce": "host_mailbox", "max_context": 190464, "dtype": "float16", "concurrency": 1,
                      "kv_cache_dtype": "int8", "speculative": "mtp", "draft_tokens": 3, "acceptance": 0.49,
                      "workload": "prose", "bundled": True}
    assert doc["launch"]["commands"][0]["argv"][:4] == ["python", "-m", "engine", "serve"]


def test_plan_out_writes_the_same_document(cli, tmp_path):
    out = tmp_path / "plan.json"
    r = cli("plan", "--json", "--out", str(out))
    assert r.exit_code == 0
    assert json.loads(out.read_text())["strategies"] == json.loads(r.stdout)["strategies"]


def test_plan_from_probe_report_defaults_gpus_to_its_cards(cli):
    doc = cli.json("plan", "--hardware", f"{PROBES}/facts-pg500-216-pair-broken-p2p.json")
    assert doc["inputs"]["gpus"] == 2
    assert doc["strategies"][3]["allreduce_path"] == "host_mailbox"
    assert any("P2P is broken" in n for n in doc["notes"])
    one = cli.json("plan", "--hardware", f"{PROBES}/h200-probe-quick.json", "--model", "llama3.1-8b-fp16", "--context", "8K")
    assert one["inputs"]["gpus"] == 1 and one["recommended"] == "single"


def test_compare_json(cli):
    doc = cli.json("compare", "--context", "128K", "v100-pg500-216x2", "rtx4090-48g", "a100-80gb")
    rows = {r["hardware"]: r for r in doc["rows"]}
    assert rows["v100-pg500-216"]["gpus"] == 2 and rows["v100-pg500-216"]["best_strategy"] == "tp2"
    # price per decode tok/s where prices are known: 2 x 3,000 CNY / decode tok/s
    v = rows["v100-pg500-216"]
    assert v["price_per_decode_tok_s"] == pytest.approx(6000 / v["decode_tok_s"], rel=1e-3)
    assert rows["a100-80gb"]["price_total"] is None and rows["a100-80gb"]["price_per_decode_tok_s"] is None


def test_profiles_list_show_validate(cli):
    listed = cli.json("profiles", "list")
    assert listed["kind"] == "catalogue_listing" and listed["provenance"]["tool"] == "v100plan"
    assert {"catalogue": "hardware", "id": "h200", "name": "H200 SXM 141GB"} in [
        {k: e[k] for k in ("catalogue", "id", "name")} for e in listed["entries"]]
    shown = cli.json("profiles", "show", "h200")
    assert shown["kind"] == "hardware_profile" and shown["id"] == "h200" and "provenance" in shown
    checked = cli.json("profiles", "validate")
    assert checked["kind"] == "validation_report" and checked["valid"] is True
    r = cli("profiles", "show", "h200")  # without --json: field and source tables, not the JSON text
    assert r.exit_code == 0 and not r.stdout.lstrip().startswith("{")
    assert "mem_bw_measured_gbps" in r.stdout and "4400.0" in r.stdout and "pair.nvlink_links" in r.stdout
    assert "sources" in r.stdout and "NVIDIA H200 datasheet" in r.stdout
    r = cli("profiles", "validate")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.stdout.count(" ok ") >= 18


def _no_traceback(r):
    assert "Traceback" not in r.stdout + r.stderr


@pytest.mark.parametrize("args, expected", [
    (["plan", "--hardware", "v100-fake"], "valid ids: a100-80gb, a100-pcie-40gb, a100-pcie-80gb, h100-pcie"),
    (["plan", "--model", "gpt-5"], "unknown model id 'gpt-5'; valid ids:"),
    (["plan", "--engine", "text-generation-inference"], "valid ids: exllamav2, gpt-fast, llamacpp, llamacpp-layer"),
    (["plan", "--context", "-5"], "a token count must be positive, got '-5'"),
    (["plan", "--context", "0"], "must be positive"),
    (["plan", "--context", "lots"], "cannot read 'lots' as a token count"),
    (["plan", "--acceptance", "1.5"], "between 0 and 1"),
    (["plan", "--gpus", "0"], "--gpus must be at least 1"),
    (["plan", "--hardware", "missing-probe.json"], "file not found"),
    (["compare", "v100-fakex2"], "unknown hardware id 'v100-fakex2'"),
    (["plan", "--hardware", f"{PROBES}/h200-probe-quick.json", "--gpus", "2"], "has 1 card(s)"),
    (["profiles", "show", "nope"], "unknown profile id 'nope'"),
    (["plan", "--engine", "missing-engine.json"], "missing-engine.json: file not found"),
    (["plan", "--engine", "tests/fixtures/multigpu/h200x2-probe-quick.json"], "expected an engine_profile document"),
    (["compare", "--engine", "missing-engine.json", "h200x2"], "file not found"),
])
def test_bad_input_is_a_message_and_exit_2(cli, args, expected):
    r = cli(*args)
    assert r.exit_code == 2, (r.stdout, r.stderr)
    assert "Error:" in r.stderr and expected in r.stderr.replace("\n", " ")
    _no_traceback(r)


def test_probe_report_of_another_major_version_is_refused(cli, tmp_path):
    doc = json.loads(Path(f"{PROBES}/facts-pg500-216-pair-broken-p2p.json").read_text())
    doc["schema_version"] = "2.0"
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(doc))
    r = cli("plan", "--hardware", str(path))
    assert r.exit_code == 2
    text = r.stderr.replace("\n", " ")
    assert "2.0" in text and "1.0" in text and "schema_version" in text
    _no_traceback(r)


def test_validate_reports_the_json_path_of_a_broken_file(cli, tmp_path):
    doc = json.loads((REPO / "profiles/hardware/h200.json").read_text())
    doc["memory_gib"] = -1
    bad = tmp_path / "h200.json"
    bad.write_text(json.dumps(doc))
    r = cli("profiles", "validate", str(bad))
    assert r.exit_code == 2
    assert "$.memory_gib" in r.stdout
    _no_traceback(r)


def test_every_plan_document_is_schema_valid(monkeypatch):
    """Every hardware x model x engine in the catalogue gives a Plan document the schema accepts."""
    import profiles.document
    from v100plan import catalogue
    from v100plan.planning import plan_document

    monkeypatch.setattr(profiles.document, "git_revision", lambda: None)  # one git call per plan is slow here
    for hw in catalogue.ids("hardware"):
        for model in catalogue.ids("model"):
            for engine in catalogue.ids("engine"):
                doc = plan_document(hw, 2, model, engine, "64K", None, 1, "latency")
                documents.validate(doc, "plan")
                assert doc["recommended"] is None or doc["launch"]["strategy"] == doc["recommended"]


def test_plan_accepts_a_hardware_profile_file(cli, tmp_path):
    doc = json.loads((REPO / "profiles/hardware/v100-pcie-32gb.json").read_text())
    doc.update(id="my-v100-box", mem_bw_measured_gbps=850.0)
    doc["sources"]["mem_bw_measured_gbps"] = "measurement, my box, 2026-11-29"
    del doc["unavailable"]["mem_bw_measured_gbps"]
    path = tmp_path / "my-box.json"
    path.write_text(json.dumps(doc))
    plan = cli.json("plan", "--hardware", str(path), "--context", "32K")
    assert plan["inputs"]["hardware"] == str(path)
    assert "850 GB/s (measured: measurement, my box" in " ".join(plan["why"])


MULTIGPU = "tests/fixtures/multigpu"


def test_plan_accepts_an_engine_profile_file(cli):
    """The measured two-H200 profile as --engine: its TP2 fractions are used (no fallback note) and the plan's
    tp2 round at 16K is the bench comparison's held-out prediction (6.889 ms vs 6.90 measured)."""
    r = cli("plan", "--hardware", f"{MULTIGPU}/h200x2-probe-quick.json", "--model", "llama3.1-8b-fp16",
            "--engine", f"{MULTIGPU}/h200x2-engine-profile.json", "--context", "16K", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    tp2 = next(s for s in doc["strategies"] if s["name"] == "tp2")
    assert tp2["round_ms"] == pytest.approx(6.889, abs=0.001)
    assert tp2["breakdown"]["decode"]["kv_bw_fraction"] == 0.2351
    assert "tp2_graph_fit" in tp2["breakdown"]["decode"]["fractions_source"]["kv"]
    assert doc["inputs"]["engine"] == "v100plan-graph-measured"
    assert not any("one-card fractions" in n for n in doc["notes"])


@pytest.mark.parametrize("name", ["engine-profile-h200-2026-11-29.json"])
def test_plan_with_a_one_gpu_engine_profile_file_says_tp2_falls_back(cli, name):
    """A profile measured on one card has no TP2 fractions: the plan says the one-card ones stand in."""
    r = cli("plan", "--hardware", "h200", "--gpus", "2", "--model", "llama3.1-8b-fp16",
            "--engine", f"tests/fixtures/engine/{name}", "--context", "32K", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert any("no tp2_weight_bw_fraction or tp2_kv_bw_fraction" in n for n in doc["notes"])
    assert all(s["decode_tok_s"] for s in doc["strategies"] if s["fits"])


def test_compare_accepts_an_engine_profile_file(cli):
    r = cli("compare", "--model", "llama3.1-8b-fp16", "--context", "32K", "--engine",
            f"{MULTIGPU}/h200x2-engine-profile.json", "h200x2", "h200", "--json")
    assert r.exit_code == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert [(x["gpus"], x["best_strategy"]) for x in rows] == [(2, "tp2"), (1, "single")]
    # catalogue h200 x 2 at 32K: the bench comparison's held-out +1.5 % on 7.877 ms measured
    assert 1000 / rows[0]["decode_tok_s"] == pytest.approx(7.995, abs=0.002)


def test_an_invalid_engine_profile_file_names_its_json_path(cli, tmp_path):
    doc = json.loads(Path(f"{MULTIGPU}/h200x2-engine-profile.json").read_text())
    doc["efficiency"]["tp2_kv_bw_fraction"]["value"] = 1.7
    bad = tmp_path / "engine.json"
    bad.write_text(json.dumps(doc))
    r = cli("plan", "--engine", str(bad))
    assert r.exit_code == 2
    assert "$.efficiency.tp2_kv_bw_fraction" in r.stderr.replace("\n", "")
    _no_traceback(r)


def test_memory_is_shown_in_gib_as_cards_are_sold_prefill_keeps_its_tenth_and_prices_their_currency(cli):
    """An H200 is a "141 GB" card (nvidia-smi: 143771 MiB): the plan says 140.4 GiB, never "150.8 GB"."""
    r = cli("plan", "--hardware", "h200", "--gpus", "2", "--model", "llama3.1-8b-fp16", "--context", "32K")
    text = " ".join(r.stdout.split())
    assert "of 140.4 GiB per GPU" in text and "150.8" not in text and "GiB/GPU" in text
    tp2 = next(line for line in r.stdout.splitlines() if line.startswith("│ tp2"))
    assert "│ 0.9 │" in " ".join(tp2.split())  # prefill 0.9 s, not rounded to 1
    c = cli("compare", "v100-pg500-216x2", "--json")
    row = json.loads(c.stdout)["rows"][0]
    shown = cli("compare", "v100-pg500-216x2").stdout
    assert f"{row['price_per_decode_tok_s']:,.0f} {row['currency']}" in shown
