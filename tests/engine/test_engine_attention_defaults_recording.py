"""Judges the H200 recordings of 2026-12-04 (bash docs/h200_defaults_run.sh a|b), the first with the apart attention
and int8's long-window blocks as the engine's defaults (engine.kernels.decode.launch_config), on CPU:

- the one-query attention's default row is the launch it is said to be: its output equals the forced row of the
  same configuration exactly (err 0.0; another tile sums in another order and differs), and its fraction follows
  from the cache bytes over its time;
- the 27B decode step (bf16 and int8 K/V) follows from its bytes, is faster than the 2026-12-01 steps at 128K and
  256K, and the bf16 step's K/V read meets the 80 % target at both (docs/engine-speed.md, 2026-12-04);
- the int4 step follows from its bytes and the GPU tests of the changed kernels passed with these defaults."""

from __future__ import annotations

import json

import pytest

from engine.kernels import decode
from tests.paths import FIXTURES

E = FIXTURES / "engine"
HEADS = {"qwen3.5-27b": (4, 256), "qwen3-8b": (8, 128)}


def load(name):
    return json.loads((E / name).read_text())


def kv_bytes(shape, kvd, ctx):
    kv, hd = HEADS[shape]
    return 2 * kv * ctx * hd * (2 if kvd == "auto" else 1) + (2 * kv * ctx * 4 if kvd == "int8" else 0)


ATTN = {"bfloat16": load("h200-attention-2026-12-04-defaults.json"),
        "float16": load("h200-attention-fp16-2026-12-04-defaults.json")}


@pytest.mark.parametrize("dtype", list(ATTN))
def test_each_default_row_is_the_launch_config_it_names_and_its_fraction_follows(dtype):
    doc = ATTN[dtype]
    assert doc["device"] == "NVIDIA H200" and doc["dtype"] == dtype and 4000 < doc["read_bw_gbps"] < 4800
    rows = [r for r in doc["rows"] if "us" in r]
    assert len(rows) == len(doc["rows"])  # nothing failed to compile
    defaults = [r for r in rows if r.get("config") == "default"]
    assert len(defaults) == (8 if dtype == "bfloat16" else 2)
    for r in rows:
        assert r["of_read"] == pytest.approx(kv_bytes(r["shape"], r["kv"], r["context"]) / (r["us"] * 1e-6)
                                             / (doc["read_bw_gbps"] * 1e9), abs=2e-3)
        assert r["err"] < 1e-2
    for d in defaults:
        kv, hd = HEADS[d["shape"]]
        bs, warps, _, stages, apart = decode.launch_config(hd, d["context"], (9, 0))
        twin = [r for r in rows if r.get("config") != "default" and (r["shape"], r["kv"], r["context"]) ==
                (d["shape"], d["kv"], d["context"]) and (r["block_s"], r["warps"], r["stages"], r["apart"]) ==
                (bs, warps, stages, apart)]
        if (dtype, d["shape"]) == ("float16", "qwen3-8b"):  # that run forced only the 27B shape's tile of 32
            assert not twin and bs == 64
            continue
        assert len(twin) == 1, d
        # the same launch sums in the same order: the default's output is the forced row's, bit for bit, and
        # its time within run-to-run noise of it
        assert twin[0]["err"] == 0.0 and d["err"] == 0.0
        assert d["us"] == pytest.approx(twin[0]["us"], rel=0.03)
        others = [r for r in rows if r.get("config") != "default" and r is not twin[0] and (
            r["shape"], r["kv"], r["context"]) == (d["shape"], d["kv"], d["context"])]
        assert all(r["err"] > 0.0 for r in others)  # a different tile is seen as different: the check can fail


def test_the_16_bit_read_meets_80_percent_at_128k_and_256k_by_default():
    for d in (r for r in ATTN["bfloat16"]["rows"] if r.get("config") == "default" and r["kv"] == "auto"):
        assert d["of_read"] >= 0.80, d  # 27B 82 % / 93 %, 8B 93 % / 99 %


def test_int8_27b_with_64_position_tiles_was_faster_than_the_default_it_is_recorded_against():
    """What the run found and the defaults do not yet take (docs/engine-speed.md, 2026-12-04): at the 27B shape
    an int8 cache read in tiles of 64 positions beat the default's 32 at both windows by about 4 %."""
    rows = ATTN["bfloat16"]["rows"]
    for ctx in (131072, 262144):
        by = {r.get("block_s") or "default": r["us"] for r in rows
              if (r["shape"], r["kv"], r["context"]) == ("qwen3.5-27b", "int8", ctx)}
        assert by[64] < 0.97 * by["default"]


def _step(doc, ctx):
    r = doc["decode"]["service_graph"][str(ctx)]
    floor = (doc["weight_bytes"] + r["kv_bytes"] + r["state_bytes"]) / (doc["read_bw_gbps"] * 1e9) * 1e3
    assert r["floor_ms"] == pytest.approx(floor, rel=2e-3)
    assert r["of_floor"] == pytest.approx(r["floor_ms"] / r["ms"], abs=1e-3)
    return r


@pytest.mark.parametrize("kvd", ["bf16", "int8"])
def test_the_27b_step_follows_from_its_bytes_and_is_faster_than_before_at_long_windows(kvd):
    now = load(f"h200-hybrid-27b{'-int8' if kvd == 'int8' else ''}-bench-2026-12-04-defaults.json")
    before = load(f"h200-hybrid-27b{'-int8' if kvd == 'int8' else ''}-bench-2026-12-01-final.json")
    assert now["device"] == before["device"] == "NVIDIA H200"
    assert now["kv_cache_dtype"] == ("int8" if kvd == "int8" else "auto") == before["kv_cache_dtype"]
    assert now["weight_bytes"] == before["weight_bytes"] and now["kv_bytes_per_token"] == before["kv_bytes_per_token"]
    for ctx in (1024, 131072, 262144):
        r, b = _step(now, ctx), _step(before, ctx)
        if ctx == 1024:  # one tile's worth of window: the attention is not the part that changed
            assert r["ms"] == pytest.approx(b["ms"], rel=0.03)
        else:  # 16 attention layers, 40-50 us faster each at 128K, ~90-150 us at 256K
            assert r["ms"] < b["ms"] - (0.5 if ctx == 131072 else 1.5), (ctx, r["ms"], b["ms"])
        if kvd == "bf16" and ctx > 1024:
            assert r["of_floor"] >= 0.80  # 83 % / 85 %


def test_int8_kv_now_costs_no_more_than_bf16_at_long_windows():
    bf16 = load("h200-hybrid-27b-bench-2026-12-04-defaults.json")
    int8 = load("h200-hybrid-27b-int8-bench-2026-12-04-defaults.json")
    for ctx in (131072, 262144):
        assert _step(int8, ctx)["ms"] < _step(bf16, ctx)["ms"]  # 16.61 < 16.74, 18.45 < 18.60 ms


@pytest.mark.parametrize("ctx", ["1024", "131072"])
def test_the_int4_step_follows_from_its_bytes(ctx):
    doc = load("h200-int4-2026-12-04-step.json")
    step, tiles = doc["step"], load("h200-int4-2026-12-03-tiles.json")["step"]
    c = step["contexts"][ctx]
    assert c["kernels"] == "fused" and c["window"] == int(ctx)
    assert step["packed_bytes"] == tiles["packed_bytes"]  # the same packed model as the day before
    floor = (step["weight_bytes"] + c["kv_bytes"] + c["state_bytes"]) / (doc["read_bw_gbps"] * 1e9) * 1e3
    assert c["floor_ms"] == pytest.approx(floor, rel=2e-3)
    assert c["of_floor"] == pytest.approx(c["floor_ms"] / c["ms"], abs=1e-3)
    assert c["ms"] < tiles["contexts"][ctx]["ms"]  # 7.80 -> 7.17 ms at 1K, 10.23 -> 9.31 ms at 128K
    assert c["of_floor"] < 0.6  # still well short of its floor: the int4 GEMV is the gap
