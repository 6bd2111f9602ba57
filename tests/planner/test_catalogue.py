"""The catalogue: every file validates, every number has a source, the facts hold together."""

from __future__ import annotations

import copy
import json

import pytest

import profiles
from v100plan import catalogue, documents
from v100plan.errors import DocumentError
from v100plan.profile_checks import catalogue_problems, unsourced_numbers

ALL = [(c, i) for c in ("hardware", "model", "engine") for i in catalogue.ids(c)]


def test_ids_required_by_the_contract_exist():
    assert {"v100-pg500-216", "v100-sxm2-32gb", "v100-pcie-32gb", "v100-pcie-16gb", "rtx4090-48g", "rtx4090-24g",
            "a100-80gb", "h100-sxm", "h200"} <= set(catalogue.ids("hardware"))
    assert {"qwen3.8-27b-nvfp4", "qwen3.8-27b-groupwise-int"} <= set(catalogue.ids("model"))
    assert {"ninfer-v100-tp", "llamacpp-layer", "v100plan"} <= set(catalogue.ids("engine"))


@pytest.mark.parametrize("cat, id_", ALL)
def test_every_catalogue_file_validates_and_sources_every_number(cat, id_):
    doc = catalogue.get(cat, id_)
    assert catalogue_problems(doc, catalogue.path_of(cat, id_)) == []


def test_a_number_without_a_source_is_caught():
    doc = copy.deepcopy(catalogue.get("hardware", "v100-pg500-216"))
    del doc["sources"]["sm_count"]
    doc["pair"]["p2p_bulk_gbps"] = 1.0  # neither a source nor a reason any more once removed from unavailable
    del doc["pair"]["unavailable"]["p2p_bulk_gbps"]
    assert unsourced_numbers(doc) == ["$.sm_count", "$.pair.p2p_bulk_gbps"]
    eng = copy.deepcopy(catalogue.get("engine", "ninfer-v100-tp"))
    eng["efficiency"]["kv_bw_fraction"] = {"value": 0.4}
    assert unsourced_numbers(eng) == ["$.efficiency.kv_bw_fraction"]


def test_broken_file_is_rejected_with_its_json_path(tmp_path):
    doc = copy.deepcopy(catalogue.get("hardware", "v100-sxm2-32gb"))
    doc["sm_count"] = "eighty"
    with pytest.raises(DocumentError) as e:
        documents.validate(doc, "hardware_profile", source="bad.json")
    assert e.value.json_path == "$.sm_count" and "bad.json" in e.value.message
    doc = copy.deepcopy(catalogue.get("engine", "ninfer-v100-tp"))
    doc["efficiency"]["weight_bw_fraction"]["value"] = 1.5      # a fraction above 1 would let speed beat the ceiling
    with pytest.raises(DocumentError) as e:
        documents.validate(doc, "engine_profile")
    assert e.value.json_path == "$.efficiency.weight_bw_fraction.value"


def test_wrong_major_schema_version_names_both():
    doc = {**catalogue.get("model", "llama3.1-8b-fp16"), "schema_version": "2.0"}
    with pytest.raises(DocumentError) as e:
        documents.validate(doc, "model_profile")
    assert "2.0" in e.value.message and "1.0" in e.value.message


@pytest.mark.parametrize("id_", catalogue.ids("hardware"))
def test_nominal_bandwidth_matches_memory_clock_and_bus(id_):
    """clock x 2 (double data rate) x bus width / 8 = nominal GB/s (docs/field-figures.md's formula), within 3 %."""
    d = catalogue.get("hardware", id_)
    implied = d["mem_clock_max_mhz"] * 2 * d["bus_width_bits"] / 8 / 1e3
    assert abs(implied - d["mem_bw_nominal_gbps"]) <= 0.03 * d["mem_bw_nominal_gbps"]
    if d["mem_bw_measured_gbps"] is not None:
        assert d["mem_bw_measured_gbps"] <= d["mem_bw_nominal_gbps"]


@pytest.mark.parametrize("id_", [i for i in catalogue.ids("hardware") if i.startswith("v100")])
def test_volta_tensor_peak_matches_sms_and_clock(id_):
    d = catalogue.get("hardware", id_)
    derived = d["sm_count"] * d["sm_clock_max_mhz"] * 1e6 * 1024 / 1e12
    assert abs(derived - d["fp16_tensor_tflops"]) <= 0.03 * derived
    assert d["bf16_tensor_tflops"] is None and d["native_bf16"] is False


def test_lent_h200_measurements():
    d = catalogue.get("hardware", "h200")
    assert (d["sm_count"], d["sm_clock_max_mhz"], d["mem_clock_max_mhz"], d["bus_width_bits"], d["power_limit_w"]) == (
        132, 1980, 3201, 6016, 700)
    assert d["memory_gib"] == pytest.approx(143771 / 1024, abs=0.05)
    assert (d["mem_bw_measured_gbps"], d["copy_bw_measured_gbps"]) == (4400.0, 4240.0)
    assert "2026-11-29" in d["sources"]["mem_bw_measured_gbps"]


@pytest.mark.parametrize("id_", catalogue.ids("model"))
def test_model_weights_add_up(id_):
    w = catalogue.get("model", id_)["weights"]
    assert w["split_gb"] + w["replicated_gb"] == pytest.approx(w["total_gb"], abs=0.01)
    assert w["decode_read_gb"] <= w["total_gb"]


def test_27b_profiles_say_what_is_not_known():
    d = catalogue.get("model", "qwen3.8-27b-nvfp4")
    assert d["hidden_size"] == 5120 and "qwen3.5-27b.config.json" in d["sources"]["hidden_size"]   # the engine's shape
    assert d["matrix_flops_per_token"] == 2 * 27e9
    # TP2 shard = split / 2 + replicated = 12.4 GB (docs/field-figures.md: 2 x 12.4 GB shard files)
    assert d["weights"]["split_gb"] / 2 + d["weights"]["replicated_gb"] == pytest.approx(12.4, abs=0.05)


def test_engine_calibration_is_written_down():
    d = catalogue.get("engine", "ninfer-v100-tp")
    parameters = " ".join(c["parameter"] for c in d["calibration"])
    for name in ("weight_bw_fraction", "kv_bw_fraction", "prefill_compute_fraction", "runtime_reserve_gb"):
        assert name in parameters
    assert catalogue.get("engine", "v100plan")["status"] == "measured"  # from its own bench recordings


def test_schemas_are_valid_json_schema():
    import jsonschema

    for path in profiles.SCHEMA_DIR.glob("*.schema.json"):
        jsonschema.Draft202012Validator.check_schema(json.loads(path.read_text()))


def test_a_profile_outside_the_catalogue_may_have_any_file_name(tmp_path):
    from pathlib import Path

    doc = catalogue.get("hardware", "h200")
    assert catalogue_problems(doc, tmp_path / "my-box.json") == []
    assert catalogue_problems(doc, Path(profiles.CATALOGUES["hardware"]) / "other.json")[0][0] == "$.id"
