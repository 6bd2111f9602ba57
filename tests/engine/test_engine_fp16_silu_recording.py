"""Judges the H200 recording of SiLU + down in fp16 and bf16 under several blocks (python -m engine.bench.int4 --skip
int4,prefill,step --silu-blocks ..., tests/fixtures/engine/h200-fp16-silu-blocks-2026-12-04.json) on CPU: the blocks
the bf16 table picks, (8, 512, 4), ran 14-18 % slower in fp16 on every down shape, and the engine's fp16 choice
(the tuning table's fp16_silu, engine.kernels.decode.prologue_blocks) brings fp16 within 5 % of bf16's choice on each, the V100 path's fp16 target."""

from __future__ import annotations

import json

import pytest
import torch

from engine import tuning
from engine.kernels import decode
from tests.paths import FIXTURES

REC = json.loads((FIXTURES / "engine" / "h200-fp16-silu-blocks-2026-12-04.json").read_text())
F = REC["fp16_vs_bf16"]
SHAPES = list(F["bfloat16"]["silu_down_by_blocks"])


def key(blocks) -> str:
    return "x".join(map(str, blocks))


def test_recorded_on_an_h200_for_the_27b_and_8b_down_shapes():
    assert REC["device"] == "NVIDIA H200"
    assert SHAPES == ["5120x17408", "4096x12288", "4096x6144"]
    for dt in ("bfloat16", "float16"):
        assert all(len(F[dt]["silu_down_by_blocks"][s]) == 9 for s in SHAPES)
    # the step's own SiLU + down figure is the table's blocks: the same launch as that row, same run
    assert F["bfloat16"]["silu_down_us"] == pytest.approx(F["bfloat16"]["silu_down_by_blocks"]["5120x17408"]["8x512x4"],
                                                          rel=0.02)
    assert F["ratio_fp16_over_bf16"]["silu_down_us"] > 1.1  # the old fp16 path: 14 % slower


@pytest.mark.parametrize("shape", SHAPES)
def test_the_engine_s_fp16_blocks_put_fp16_within_5_percent_of_bf16(shape):
    n, k = (int(v) for v in shape.split("x"))
    bf, fp = F["bfloat16"]["silu_down_by_blocks"][shape], F["float16"]["silu_down_by_blocks"][shape]
    b_bf = key(decode.prologue_blocks("silu", n, k, torch.bfloat16))
    b_fp = key(decode.prologue_blocks("silu", n, k, torch.float16))
    assert b_bf == "8x512x4" and b_fp == key(tuning.load((7, 0)).fp16_silu)
    assert fp["8x512x4"] > 1.1 * bf["8x512x4"]  # the bf16 blocks in fp16: 14-18 % slower
    assert fp[b_fp] <= 1.05 * bf[b_bf]  # 1.008, 1.014, 1.022
    assert fp[b_fp] == min(fp.values())  # the fastest fp16 row of each shape
    assert bf[b_bf] == min(bf.values())  # and bf16 keeps its own fastest
