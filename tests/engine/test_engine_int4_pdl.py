"""The int4 GEMV launched while its row kernel still runs (programmatic dependent launch, engine.kernels.gemv_int4):
compiled for sm_90 without a GPU, the GEMV issues its first tile's weight loads, then waits on grid dependency
control before it reads anything the row kernel writes; the row kernel lets it launch at once; neither carries
the instructions with PDL off; and where PDL is on at all (the card, Triton, and the switch a decoder sets when it
is built)."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


def _ptx(label_kind: str, pdl: bool) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.core import sm70
    from engine.kernels.gemv_int4_jit import int4_gemv_kernel as int4
    from engine.kernels.gemv_int4_jit import int4_row_kernel as row

    if label_kind == "gemv":
        kern, warps = int4, 4
        cx = dict(HAS_BIAS=False, BLOCK_N=64, BLOCK_K=128, GS=128, ZOFF=1, EMU=False, SEND=False, EPW=2, STAGES=2,
                  PAIRS=True, ASM=True, EVEN_N=True, EVEN_K=True, SPLIT=4, TB=32, TW=16, PDL=pdl)
    else:
        kern, warps = row, 4
        cx = dict(HAS_PERM=False, SUB=128, EMU=False, STATS_BLOCK=8192, PAIRS=True, PROLOGUE=1, PDL=pdl)
    cx = sm70.with_defaults(kern, cx)
    sig = sm70._signature(kern, cx, {"s_ptr": "*bf16"} if label_kind == "gemv" else {
        "x_ptr": "*bf16", "d_ptr": "*bf16", "nw_ptr": "*bf16", "xo_ptr": "*bf16"})
    # as a launch specialises them: 16-byte-aligned pointers, and the sizes of the 27B gate/up (N 34816, K 5120,
    # 640 words a row, 160 a slice) multiples of 16
    aligned = [i for i, n in enumerate(kern.arg_names) if n not in cx and (sig[n].startswith("*") or n in (
        "N", "K", "KW", "KS"))]
    src = ASTSource(fn=kern, signature=sig, constexprs=cx, attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]


def test_the_gemv_loads_its_first_words_then_waits_for_the_row_kernel():
    ptx = _ptx("gemv", True)
    body = ptx[ptx.index(".entry"):]
    waits = [m.start() for m in re.finditer(r"griddepcontrol\.wait", body)]
    assert len(waits) == 1
    loads = [m.start() for m in re.finditer(r"ld\.global\.L1::evict_first[^;]*\.v4", body)]  # the words
    assert loads and loads[0] < waits[0]  # the first tile's words are in flight before the wait
    # and nothing of h (the fp16 pairs the row kernel writes: the f16x2 products) is used before it
    assert body.find("fma.rn.f16x2") > waits[0]
    assert "griddepcontrol.wait" not in _ptx("gemv", False)


def test_the_row_kernel_lets_the_gemv_launch_at_once():
    ptx = _ptx("row", True)
    body = ptx[ptx.index(".entry"):]
    trig = body.find("griddepcontrol.launch_dependents")
    assert 0 <= trig < body.find("ld.global")  # before its first load
    assert "griddepcontrol" not in _ptx("row", False)


def test_pdl_only_on_hopper_and_later_with_triton_and_not_when_the_decoder_turned_it_off(monkeypatch):
    from engine.core import config, decode_mode, runner
    from engine.core.model import Model
    from engine.kernels import gemv_int4
    from tests.engine_helpers import small_config

    monkeypatch.setattr(gemv_int4, "_PDL", [True])  # the switch as a process starts, put back after the test
    assert gemv_int4.pdl_enabled(torch.device("cpu")) is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(gemv_int4, "interpreting", lambda: False)
    hopper = torch.device("cuda", 0)
    assert gemv_int4.pdl_enabled(hopper) is gemv_int4._triton_pdl() is True
    # the operator's switch: a decoder's argument, else the environment, read when the decoder is built, not later
    model = Model(config.from_dict(small_config("qwen3-8b")), dtype=torch.float32, device="cpu")
    model.setup_cache(16)
    monkeypatch.setenv(decode_mode.INT4_PDL_ENV, "0")
    assert runner.Decoder(model).mode.int4_pdl is False and gemv_int4.pdl_enabled(hopper) is False
    assert runner.Decoder(model, int4_pdl=True).mode.int4_pdl is True and gemv_int4.pdl_enabled(hopper) is True
    for cap in ((7, 0), (8, 0), (8, 9)):  # V100, A100, L40: no grid dependency control
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        assert gemv_int4.pdl_enabled(hopper) is False
