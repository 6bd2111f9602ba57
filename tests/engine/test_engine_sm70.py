"""The V100 path: every Triton kernel of the fused decode step compiled for sm_70 in fp16 without a GPU
(engine/core/sm70.py, in a process of its own), and the kernel choice per card with and without Triton and an
sm_70 ptxas."""

from __future__ import annotations

import importlib.util
import json

import pytest

from engine.core import runner
from tests import early

FOUND = (True, "ptxas 12.9 (the nvidia-cuda-nvcc-cu12 wheel) compiles sm_70")
MISSING = (False, "Triton 3.9's bundled ptxas: ptxas 13.0 does not compile sm_70")


@pytest.mark.parametrize("cap,triton,ptxas,want,why", [
    ((7, 0), True, FOUND, "fused", "compiled for sm_70 by ptxas 12.9"),
    ((7, 0), True, MISSING, "eager", "compute capability 7.0 < 8.0 and Triton 3.9's bundled ptxas: ptxas 13.0"),
    ((7, 0), True, None, "eager", "no ptxas for sm_70 was looked for"),
    ((7, 0), False, FOUND, "eager", "Triton is not installed"),
    ((8, 0), True, None, "fused", "five Triton kernels per layer"),
    ((8, 0), False, None, "eager", "Triton is not installed"),
    ((9, 0), True, MISSING, "fused", "five Triton kernels per layer"),  # sm_90 needs no CUDA 12 ptxas
    ((9, 0), False, None, "eager", "Triton is not installed"),
    ((6, 1), True, FOUND, "eager", "compute capability 6.1 < 7.0"),
])
def test_kernel_choice_per_card(cap, triton, ptxas, want, why):
    got, reason = runner.kernel_choice("cuda", cap, triton, None, ptxas)
    assert got == want and why in reason, reason


# `python -m engine.core.sm70`, which may start early in the background (tests/early.py): it measures no time
SM70 = early.Spec("engine.core.sm70", set_env=(("TRITON_DEFAULT_FP_FUSION", "1"),), timeout_s=600)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed: nothing to compile")
@pytest.mark.early(SM70)
def test_every_v100_kernel_compiles_to_sm70_sass_in_fp16():
    res = early.run(SM70)
    out = json.loads(res.stdout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert out["target"] == "sm_70" and out["ptxas_found"], out["ptxas"]
    names = {k["kernel"] for k in out["kernels"]}
    assert {"gemv_prologue:norm", "gemv_prologue:silu+send", "attention", "int4_row:norm", "int4_row:silu",
            "int4_gemv:send", "int4_gemv:split-K", "int4_dequant", "exchange_finish:norm", "gdn_decode:27b",
            "int4_rows:FMA form, 2 rows, bias", "int4_rows:DOT form, 16 rows (FMA code on sm_70), split-K",
            "gdn_chunk:27b prefill", "gdn_chunk:27b prefill parts",
            "attention:int8 K/V"} <= names and any(n.startswith("attention:27b gated") for n in names)
    for k in out["kernels"]:
        assert k["error"] is None and k["sass_arch"] == 70 and k["ptx_target"] == "sm_70" and k["cubin_bytes"] > 0, k
        assert k["shared_bytes"] <= 96 * 1024, k  # what a V100 block can have


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_every_variant_compiles_the_specialisation_a_launch_gets():
    # a constexpr left out of the compile would be a runtime i32: both sides of each branch on it compiled in,
    # which is not the kernel a launch runs (the int8 attention's fp16 widening once broke the 16-bit one so)
    from engine.core import sm70

    for label, kern, cx, *_ in sm70.variants():
        full = sm70.with_defaults(kern, cx)
        assert {p.name for p in kern.params if p.is_constexpr} <= set(full), label
        assert set(cx) <= set(full) and all(full[k] == v for k, v in cx.items()), label
