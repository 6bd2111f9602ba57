"""The fused decode kernels (kernel choice "fused": engine/kernels/decode.py, the one-query attention and the
prologue GEMVs) on CPU: where the choice is made, how the window is split, and every kernel against the
plain torch blocks under Triton's interpreter, in a child pytest (tests/engine_fused_cases.py; the
interpreter must be on before triton is first imported, and torch.compile in other tests imports it).
The same kernels on a GPU, bf16 and in a CUDA graph: tests/engine/test_engine_fused_gpu.py."""

from __future__ import annotations

import importlib.util

import pytest

from engine.core import runner
from engine.kernels import decode
from tests.engine_helpers import interpreter_spec, run_interpreter_cases


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Triton is not installed: the fused kernels cannot run (pip install triton)")
@pytest.mark.early(interpreter_spec("tests/engine_fused_cases.py"))
def test_every_fused_kernel_matches_the_plain_blocks_under_the_triton_interpreter():
    run_interpreter_cases("tests/engine_fused_cases.py", 19)


def test_window_is_split_into_whole_tiles_for_about_two_programs_per_sm():
    assert decode.splits_for(1024, 8, 32) == (32, 32)  # Qwen3-8B TP1: 256 programs of one tile
    assert decode.splits_for(1024, 4, 32) == (32, 32)  # TP2
    assert decode.splits_for(1024, 8, 128) == (8, 128)  # the tiles limit the programs
    n, chunk = decode.splits_for(32768, 8)
    assert n * chunk >= 32768 and chunk % decode.BLOCK_S == 0 and n * 8 <= decode.TARGET_PROGRAMS
    assert decode.splits_for(48, 2, 32) == (2, 32)
    assert decode.splits_for(10, 2, 32) == (1, 32)
    assert decode.attention_supported(128, 32, 8) and decode.attention_supported(64, 14, 2)
    assert not decode.attention_supported(48, 4, 2)  # a head dimension that is not a power of two: plain attention


@pytest.mark.parametrize("device,cap,triton,requested,want,why", [
    ("cuda", (9, 0), True, "fused", "fused", "requested: five Triton kernels per layer"),
    ("cuda", (8, 0), True, "fused", "fused", "one kernel for q/k norm, RoPE, the cache write"),
    ("cuda", (7, 0), True, "fused", "eager", "compute capability 7.0 < 8.0"),  # never on a V100
    ("cuda", (9, 0), False, "fused", "eager", "Triton is not installed"),
    ("cpu", None, True, "fused", "eager", "CPU"),
])
def test_fused_is_chosen_only_where_triton_targets_the_card(device, cap, triton, requested, want, why):
    got, reason = runner.kernel_choice(device, cap, triton, requested)
    assert got == want and why in reason


def test_a_cpu_decoder_asked_for_fused_kernels_runs_the_plain_blocks():
    import torch

    from engine.core import config as ecfg
    from engine.core.model import Model
    from tests.engine_helpers import small_config

    model = Model(ecfg.from_dict(small_config("llama-3.1-8b")), dtype=torch.float32, device="cpu")
    model.setup_cache(64)
    dec = runner.Decoder(model, kernels="fused")
    assert dec.kernels == "eager"


