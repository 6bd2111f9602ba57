"""`v100plan calibrate --endpoint URL`: a served one-stream decode measured at several contexts becomes an
EngineProfile that `plan --engine FILE` reads, and the plan's prediction is printed beside each served figure.

Against real servers on 127.0.0.1: the bundled engine (`python -m engine serve` on the demo model, CPU) and
Hugging Face's `transformers serve` (tests/independent_server.py). The card is a hardware profile for this
CPU host written by the test: calibrate's fractions are of whatever bandwidth the profile says, and the same
profile plans the prediction. About 1 minute on 2 idle cores.
"""

from __future__ import annotations

import json

import pytest

from tests.independent_server import independent_server  # noqa: F401 - the session fixture
from tests.test_service_support import demo_model, service_fixture
from v100plan import catalogue, documents, plan_inputs
from v100plan.calibrate.endpoint import Measurement, Point
from v100plan.calibrate.endpoint_profile import engine_profile, side_by_side
from v100plan.errors import BadInput
from v100plan.planner import hardware_from_doc

svc = service_fixture()
SIZES = ["--prompt-tokens", "16,240,720", "--short", "8", "--long", "72", "--repeats", "4"]


@pytest.fixture(scope="module")
def cpu_host(tmp_path_factory) -> str:
    d = json.loads(json.dumps(catalogue.get("hardware", "tesla-p40")))
    d.update(id="cpu-host", name="this CPU host", description="the test host's CPU", architecture="cpu",
             compute_capability="0.0", native_bf16=False, mem_bw_nominal_gbps=20.0, memory_gib=8, fp16_tensor_tflops=None)
    d["sources"]["mem_bw_nominal_gbps"] = "the test's assumption for this host's DRAM (fractions are of this figure)"
    d["unavailable"]["fp16_tensor_tflops"] = "a CPU"
    path = tmp_path_factory.mktemp("hw") / "cpu-host.json"
    path.write_text(json.dumps(d))
    return str(path)


def _synthetic(fw: float, fk: float, bw: float, model, contexts=(100, 1100, 3100)) -> Measurement:
    """Points that follow the planner's round exactly: t = weights / (bw fw) + KV(c) / (bw fk)."""
    m = Measurement("http://127.0.0.1:1", "synthetic", None, True)
    for c in contexts:
        ms = model.decode_read_gb / (bw * fw) * 1e3 + model.kv_bytes_per_token * c / 1e9 / (bw * fk) * 1e3
        m.points.append(Point(c - 40, 8, 72, [0.1], [0.1 + ms * 64 / 1e3]))
    return m


def test_the_fit_gives_back_the_fractions_a_straight_line_was_made_of():
    model, _ = plan_inputs.load_model("engine/data/llama-3.1-8b.config.json", "bf16", None)
    hw = hardware_from_doc(catalogue.get("hardware", "h100-sxm"), 1)
    m = _synthetic(0.8, 0.5, hw.card.read_bw.value, model)
    doc = documents.validate(engine_profile(m, model, hw, "t"), "engine_profile")
    hopper = doc["by_generation"]["hopper"]            # the card's generation: elsewhere a plan says they stand in
    assert hopper["weight_bw_fraction"]["value"] == pytest.approx(0.8, rel=1e-4)
    assert hopper["kv_bw_fraction"]["value"] == pytest.approx(0.5, rel=1e-4)
    assert doc["efficiency"]["weight_bw_fraction"]["value"] is None
    assert doc["calibration"][0]["contexts"] == [100, 3100]        # the middle point is held out
    rows = side_by_side(doc, m, model, hw)
    assert [r["role"] for r in rows] == ["fitted", "held_out", "fitted"]
    assert all(abs(r["error"]) < 1e-3 for r in rows)
    from v100plan.planner import Target, engine_from_doc, plan

    other = plan(hardware_from_doc(catalogue.get("hardware", "a100-80gb"), 1), model, engine_from_doc(doc), Target(4096, 1))
    assert other.speeds["calibrated"] is False and other.speeds["stand_in"]["generation"] == "hopper"


def test_a_server_faster_than_the_card_allows_is_refused():
    model, _ = plan_inputs.load_model("engine/data/llama-3.1-8b.config.json", "bf16", None)
    hw = hardware_from_doc(catalogue.get("hardware", "tesla-p40"), 1)
    with pytest.raises(BadInput, match="faster than tesla-p40"):
        engine_profile(_synthetic(0.8, 0.5, 3350.0, model), model, hw, "t")


def test_bad_input_and_an_absent_server(cli, cpu_host):
    base = ["calibrate", "--model", demo_model(), "--hardware", cpu_host]
    r = cli(*base, "--endpoint", "http://127.0.0.1:9", "--prompt-tokens", "64")
    assert r.exit_code == 2 and "two or more" in r.stderr
    r = cli(*base, "--endpoint", "http://127.0.0.1:9")
    assert r.exit_code == 4 and "no answer from http://127.0.0.1:9" in r.stderr and "Traceback" not in r.stderr


def test_the_bundled_engine_is_predicted_from_its_own_profile(cli, svc, cpu_host, tmp_path):
    """The issue's target is within 10 % (docs/planner-accuracy.md records the measured errors); a test on a
    shared 2-core host cannot hold a timing to that without flaking (DESIGN.md: benchmarks are commands, not timed
    tests), so it bounds the error at 30 %, which a wrong fit (a unit or a sign) would still break."""
    out = tmp_path / "served.json"
    for _ in range(3):  # a busy shared host can spoil one run's timings; a wrong fit fails all three
        doc = cli.json("calibrate", "--endpoint", svc.url, "--model", demo_model(), "--hardware", cpu_host,
                       "--weights", "fp32", *SIZES, "--out", str(out))
        if all(abs(r["error"]) <= 0.30 for r in doc["side_by_side"]):
            break
    rows = doc["side_by_side"]
    assert len(rows) == 3 and doc["measurement"]["ignore_eos"] is True
    assert [r["role"] for r in rows] == ["fitted", "held_out", "fitted"]
    for r in rows:
        assert abs(r["error"]) <= 0.30, rows
    # the written profile is what `plan --engine FILE` reads, and it plans the held-out point as printed
    held = next(r for r in rows if r["role"] == "held_out")
    p = cli.json("plan", "--engine", str(out), "--hardware", cpu_host, "--gpus", "1", "--model", demo_model(),
                 "--weights", "fp32", "--context", str(held["context_tokens"]))
    assert p["strategies"][0]["decode_tok_s"] == pytest.approx(held["predicted_tok_s"], rel=1e-6)
    text = cli("calibrate", "--endpoint", svc.url, "--model", demo_model(), "--hardware", cpu_host, "--weights", "fp32",
               "--prompt-tokens", "16,240", "--short", "8", "--long", "40", "--repeats", "1").stdout
    assert "served tok/s" in text and "planned tok/s" in text


def test_an_independent_server_is_calibrated_from_its_own_token_counts(cli, independent_server, cpu_host, tmp_path):  # noqa: F811
    """transformers serve takes no ignore_eos (an unknown field is a 422): calibrate counts what it generated, and
    the profile it writes plans each point as printed (the error beside it is reported, not bounded: the 10 %
    target is the bundled engine's, whose steps do not wait on Python's generate loop)."""
    out = tmp_path / "independent.json"
    args = ("calibrate", "--endpoint", independent_server.url, "--model", str(independent_server.model_dir),
            "--hardware", cpu_host, "--weights", "fp32", *SIZES, "--out", str(out), "--json")
    for _ in range(3):  # a busy shared host can make one run's long-minus-short timing read faster than memory
        r = cli(*args)  # allows (calibrate then refuses it, exit 2); a server calibrated wrongly fails every run
        if r.exit_code == 0 or "decodes faster than" not in r.stderr:
            break
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["measurement"]["ignore_eos"] is False
    assert doc["measurement"]["served_model"] == independent_server.model
    rows = doc["side_by_side"]
    assert len(rows) == 3 and all(r["predicted_tok_s"] and r["error"] is not None for r in rows)
    for p, r in zip(doc["measurement"]["points"], rows):
        assert p["long_tokens"] > p["short_tokens"] > 0 and r["served_tok_s"] == pytest.approx(1e3 / p["ms_per_token"], rel=1e-3)
    plan = cli.json("plan", "--engine", str(out), "--hardware", cpu_host, "--gpus", "1", "--model",
                    str(independent_server.model_dir), "--weights", "fp32", "--context", str(rows[1]["context_tokens"]))
    assert plan["strategies"][0]["decode_tok_s"] == pytest.approx(rows[1]["predicted_tok_s"], rel=1e-6)
