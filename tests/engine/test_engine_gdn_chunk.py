"""engine.kernels.gdn_chunk: the Gated DeltaNet prefill kernel against engine.kernels.gdn's forms (under Triton's
interpreter, tests/engine_gdn_chunk_cases.py), and the prefill's kernel choice."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.core import config as ecfg
from engine.core import weights
from engine.core.model import Model
from engine.kernels import gdn_chunk
from engine.model.base import Chunk
from tests.engine_helpers import interpreter_spec, run_interpreter_cases


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Triton is not installed: the kernel cannot run (pip install triton)")
@pytest.mark.early(interpreter_spec("tests/engine_gdn_chunk_cases.py"))
def test_the_prefill_kernel_equals_the_torch_forms_under_the_triton_interpreter():
    run_interpreter_cases("tests/engine_gdn_chunk_cases.py", 6)


def test_head_sizes_the_kernel_holds():
    assert gdn_chunk.supported(128, 128) and gdn_chunk.supported(16, 256)
    assert not gdn_chunk.supported(96, 128) and not gdn_chunk.supported(128, 512) and not gdn_chunk.supported(8, 8)


def test_a_cpu_model_prefills_with_the_torch_form(monkeypatch):
    from tests.engine.test_engine_hybrid import SMALL

    monkeypatch.delenv("V100PLAN_ENGINE_KERNELS", raising=False)
    m = Model(ecfg.from_dict(dict(SMALL, model_type="qwen3_5_text")), dtype=torch.float32, device="cpu")
    layer = next(la for la in m.layers if la.kind == "linear_attention")
    weights.init_random(m)  # the loader hands the model the kernel choice for its device
    assert m.kernels == "eager" and not layer.chunk_kernel(Chunk(0, None, None, kernels=m.kernels), m.dtype, m.device)
    # "fused" asked for, but the kernels do not run on CPU tensors outside the tests' interpreter
    assert not layer.chunk_kernel(Chunk(0, None, None, kernels="fused"), torch.bfloat16, m.device)
