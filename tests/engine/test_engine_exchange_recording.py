"""The exchange modes measured on two H200s (nvidia-h200-x2, 2026-12-01, tests/fixtures/multigpu/record-h200x2-run5.sh:
`python -m engine bench-tp2` on the Qwen3-8B shape, bf16, 1K context, device_mailbox_graph; each run times the
TP2 graph step of every exchange mode on the same model, one after another). The figures are recomputed from
the recordings; engine.core.decode_mode.EXCHANGE_DEFAULT must be the mode that was fastest ("norm-receive" is recorded under its
earlier name, "gemv")."""

from __future__ import annotations

import json

from engine.core import decode_mode
from tests.paths import FIXTURES

FIX = FIXTURES / "multigpu"


def _load(name: str) -> dict:
    return json.loads((FIX / name).read_text())


def _steps(doc: dict) -> dict[str, float]:
    """mode -> TP2 graph step ms at 1K (the chosen mode's decode_graph and the others' A/B entries)."""
    row = doc["tp2"]["device_mailbox_graph"]
    out = {row["decode_graph"]["1024"]["exchange"]: row["decode_graph"]["1024"]["ms"]}
    for k, v in row.items():
        if k.startswith("decode_graph_exchange_"):
            assert v["1024"]["exchange"] == k.rsplit("_", 1)[1]
            out[v["1024"]["exchange"]] = v["1024"]["ms"]
    return out


def test_the_recordings_are_two_h200s_on_the_qwen3_8b_shape():
    for name in ("h200x2-exchange-modes-2026-12-01.json",):
        doc = _load(name)
        assert [c["device"] for c in doc["cards"]] == ["NVIDIA H200", "NVIDIA H200"]
        assert doc["cards"][0]["uuid"] != doc["cards"][1]["uuid"] and not doc["cards"][0]["shared_device"]
        assert doc["created_utc"].startswith("2026-12-01") and doc["dtype"] == "bfloat16"
        assert "qwen3-8b" in doc["config"] and doc["contexts"] == [1024]
        assert doc["tp2"]["device_mailbox_graph"]["decode_graph"]["1024"]["kernels"] == "fused"


def test_send_was_the_fastest_mode_and_is_the_default():
    doc = _load("h200x2-exchange-modes-2026-12-01.json")
    steps = _steps(doc)
    assert set(steps) - {"gemv"} == set(decode_mode.EXCHANGES)  # "gemv": the deleted "norm-receive"
    assert steps == {"kernel": 2.8431, "gemv": 3.0275, "send": 2.7418}
    assert min(steps, key=steps.get) == decode_mode.EXCHANGE_DEFAULT == "send"
    # the bench's summary agrees with the recomputed ratios
    tp1 = doc["tp1"]["rank0"]["decode_graph"]["1024"]["ms"]
    s = doc["summary"]["device_mailbox_graph"]
    for mode, ms in steps.items():
        ratio = round(tp1 / ms, 4)
        key = "tp2_vs_tp1_bench" if mode == "kernel" else f"tp2_vs_tp1_bench_exchange_{mode}"
        assert s[key] == ratio
    assert round(tp1 / steps["send"], 3) == 1.59  # short of the 1.6x TP2 target in this run
    # what the send mode saves per exchange against the allreduce kernel (72 per step)
    per = (steps["kernel"] - steps["send"]) / 72 * 1e3
    assert 1.0 < per < 2.0, per

