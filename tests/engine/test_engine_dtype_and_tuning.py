"""One dtype rule (engine.dtype_rule) that serve, generate and bench agree on for the same card, and the tuning
tables as data (engine.tuning): each card family's file, the stated stand-in for a card without one, what a bench
writes is what the loader reads, and the decoder reads its table once when it is built and reports it."""

from __future__ import annotations

import argparse
import json

import pytest

from engine import dtype_rule, tuning

CARDS = [((7, 0), "float16"), ((8, 0), "bfloat16"), ((9, 0), "bfloat16"), ("cpu", "float32")]


@pytest.mark.parametrize("card,want", CARDS)
def test_serve_generate_and_bench_take_the_same_dtype_for_a_card(card, want, monkeypatch):
    import torch

    from engine.service import generate
    from engine.service.serve_config import add_serve_arguments, config_from_args
    from tests.test_service_support import demo_model

    assert dtype_rule.dtype_for(card) == want
    cuda = card != "cpu"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: card)
    # generate: its default for the device
    got_generate = generate._default_dtype("cuda:0" if cuda else "cpu")
    # serve: the proxy's config, then what each rank resolves it to on its card (engine/service/rank.py)
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    cfg = config_from_args(p.parse_args(["--model", demo_model(), "--device", "cuda:0,cuda:0" if cuda else "cpu"]))
    got_serve = dtype_rule.resolve(cfg.dtype, card)
    # bench (engine/bench/decode.py, engine/bench/tp2.py): no --dtype given
    got_bench = dtype_rule.resolve(None, card)
    assert got_generate == got_serve == got_bench == want
    assert dtype_rule.resolve("float32", card) == "float32"  # a dtype asked for wins


def test_the_rule_refuses_what_is_not_a_card_or_a_dtype():
    with pytest.raises(ValueError, match="compute capability"):
        dtype_rule.dtype_for("v100")
    with pytest.raises(ValueError, match="expected one of float32, float16, bfloat16 or auto"):
        dtype_rule.resolve("fp8", (9, 0))


def test_the_control_plane_may_import_the_rule_without_torch():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(dtype_rule.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__"}, imported


def test_each_family_reads_its_table_and_a_card_without_one_says_what_stands_in():
    hopper = tuning.load((9, 0))
    assert hopper.family == "hopper" and hopper.note is None and hopper.source.endswith("hopper.json")
    assert hopper.gemv[(4096, 4096)] == (2, 1024, 4) and hopper.int4[("norm", 34816, 5120)] == (64, 128, 4, 4, 2, 1)
    assert hopper.prologue[("silu", 4096, 12288)] == (8, 512, 4) and hopper.fp16_silu == (4, 512, 4)
    volta = tuning.load((7, 0))  # no volta.json yet: the hopper table, and a note that says so
    assert volta.family == "hopper" and "no tuning table for compute capability 7.0 (volta)" in volta.note
    assert "CPU" in tuning.load(None).note and volta.info()["note"] == volta.note


def test_a_table_a_bench_writes_is_the_one_the_loader_reads(tmp_path):
    path = tmp_path / "ampere.json"
    tuning.write(path, "int4", {"norm:512x5120": [32, 128, 2, 8, 2, 1]}, measured_on="NVIDIA A100")
    tuning.write(path, "gemv", {"4096x4096": [4, 512, 4]})
    table = tuning.load((8, 0), str(path))
    assert table.int4[("norm", 512, 5120)] == (32, 128, 2, 8, 2, 1) and table.gemv[(4096, 4096)] == (4, 512, 4)
    assert table.int4[("silu", 5120, 17408)] == tuning.load((9, 0)).int4[("silu", 5120, 17408)]  # the rest kept
    with pytest.raises(ValueError, match="malformed"):
        tuning.write(path, "gemv", {"4096x4096": ["wide"]})
    assert json.loads(path.read_text())["gemv"]["4096x4096"] == [4, 512, 4]  # the bad entry was not written
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="cannot be read"):
        tuning.load((8, 0), str(tmp_path / "bad.json"))


def test_the_decoder_reads_its_table_once_and_reports_it(tmp_path, monkeypatch):
    import torch

    from engine.core import config as ecfg
    from engine.core import runner
    from engine.core.model import Model
    from tests.engine_helpers import small_config

    path = tmp_path / "t.json"
    tuning.write(path, "gemv", {"7x9": [1, 16, 1]})
    monkeypatch.setenv(tuning.OVERRIDE_ENV, str(path))
    model = Model(ecfg.from_dict(small_config("qwen3-8b")), dtype=torch.float32, device="cpu")
    model.setup_cache(16)
    dec = runner.Decoder(model)
    try:
        assert dec.info["tuning"] == {"family": "hopper", "source": str(path), "note": None}
        assert tuning.active() is dec.tuning and tuning.active().gemv[(7, 9)] == (1, 16, 1)
        monkeypatch.delenv(tuning.OVERRIDE_ENV)
        assert tuning.active().gemv[(7, 9)] == (1, 16, 1)  # read when built, not again
    finally:
        tuning.use(tuning.load(None))
