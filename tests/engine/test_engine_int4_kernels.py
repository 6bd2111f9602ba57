"""The int4 GEMV, its prologues and send epilogue, and the prefill dequantise (engine/kernels/gemv_int4.py) against
dequantise-then-matmul, and fused decode steps on GPTQ / AWQ weights against the plain step, under Triton's
interpreter in a child pytest (tests/engine_int4_cases.py)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.engine_helpers import interpreter_spec, run_interpreter_cases


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Triton is not installed: the int4 kernels cannot run (pip install triton)")
@pytest.mark.early(interpreter_spec("tests/engine_int4_cases.py"))
def test_every_int4_kernel_matches_dequantise_then_matmul_under_the_triton_interpreter():
    run_interpreter_cases("tests/engine_int4_cases.py", 43)
