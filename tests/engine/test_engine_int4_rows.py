"""The batched int4 GEMV (engine.kernels.gemv_int4.launch_rows: 2..16 rows of a batched decode step through one packed
matrix, each weight word read once): against dequantise-then-matmul and the one-row GEMV under Triton's interpreter
(tests/engine_int4_rows_cases.py, a child pytest); compiled for sm_90 without a GPU, its DOT form multiplies on tensor
cores and its FMA form does not need them; PackedLinear.linear's routing by rows on a GPU; the bench's arguments.
On a GPU: tests/engine/test_engine_int4_gpu.py. The sm_70 compile: tests/engine/test_engine_sm70.py."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

from engine.core import quant
from tests.engine_helpers import interpreter_spec, run_interpreter_cases
from tests.paths import REPO

HAVE_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed: the int4 kernels cannot run")
@pytest.mark.early(interpreter_spec("tests/engine_int4_rows_cases.py"))
def test_the_batched_int4_gemv_matches_dequantise_then_matmul_and_the_one_row_gemv_under_the_interpreter():
    run_interpreter_cases("tests/engine_int4_rows_cases.py", 14)


def _ptx(capability: int, cx: dict, act: str = "*bf16") -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.core import sm70
    from engine.kernels.gemv_int4_rows_jit import int4_rows_kernel as kern

    base = dict(HAS_BIAS=True, HAS_PERM=False, M_PAD=16, BLOCK_N=64, BLOCK_K=128, GS=128, ZOFF=1, DOT=True,
                DOT_F32=False, EMU=False, SPLIT=1, EVEN_K=True, EVEN_N=True, TB=32, TW=16)
    cx = sm70.with_defaults(kern, {**base, **cx})
    sig = sm70._signature(kern, cx, {"x_ptr": act, "y_ptr": act, "b_ptr": act})
    src = ASTSource(fn=kern, signature=sig, constexprs=cx)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4}).asm["ptx"]


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("act", ["*bf16", "*fp16"])
def test_on_sm90_the_dot_form_multiplies_on_tensor_cores_and_the_fma_form_in_float32(act):
    dot = _ptx(90, {"SPLIT": 4, "HAS_PERM": True}, act)
    assert re.search(r"\bwgmma\.|\bmma\.sync\.", dot)  # the 16-bit tiles on tensor cores (Hopper: wgmma)
    assert "cvt.rn.f16.s32" not in dot and "cvt.rn.bf16.s32" not in dot  # q - z made from bits, not converted
    fma = _ptx(90, {"DOT": False, "M_PAD": 4, "BLOCK_N": 32}, act)
    assert not re.search(r"\bwgmma\.|\bmma\.sync\.", fma) and "fma.rn.f32" in fma


class _OnGpu:
    """Just enough of a CUDA tensor for PackedLinear.linear's routing (no GPU here)."""

    def __init__(self, *shape):
        self.shape, self.device, self.dtype = torch.Size(shape), torch.device("cuda"), torch.bfloat16

    def numel(self) -> int:
        return self.shape.numel()


def test_packed_linear_takes_the_batched_gemv_for_2_to_16_rows_on_a_gpu(monkeypatch):
    from engine.kernels import gemv_int4

    calls = []
    monkeypatch.setattr(gemv_int4, "linear", lambda x, w, b=None: calls.append(("one", x.shape)) or "one")
    monkeypatch.setattr(gemv_int4, "linear_rows", lambda x, w, b=None: calls.append(("rows", x.shape)) or "rows")

    def dequantise(w, dtype):
        raise LookupError("dequantised")

    monkeypatch.setattr(gemv_int4, "dequantise", dequantise)
    g = torch.Generator().manual_seed(0)
    w = quant.PackedLinear(quant.pack(torch.randint(0, 16, (32, 128), generator=g)),
                           quant.pack(torch.randint(0, 16, (1, 32), generator=g)), torch.ones(1, 32).half(), None, 128,
                           1, "t")
    assert w.linear(_OnGpu(1, 1, 128)) == "one"
    for shape in ((2, 128), (5, 1, 128), (16, 1, 128), (1, 16, 128)):
        assert w.linear(_OnGpu(*shape)) == "rows"
    assert calls == [("one", (1, 1, 128)), ("rows", (2, 128)), ("rows", (5, 1, 128)), ("rows", (16, 1, 128)),
                     ("rows", (1, 16, 128))]
    with pytest.raises(LookupError, match="dequantised"):  # 17 rows (a prefill chunk): dequantise + cuBLAS
        w.linear(_OnGpu(17, 128))
    assert len(calls) == 5
    x = torch.randn(3, 128, generator=g)  # on the CPU: the dequantised product, as before
    assert torch.allclose(w.linear(x), x @ w.dequantise(torch.float32).t(), atol=1e-5) and len(calls) == 5


def test_the_bench_parses_its_arguments_and_names_its_matrices_without_a_gpu(capsys):
    from engine.bench import int4_rows

    cfg = json.loads((REPO / "engine/data/qwen3.5-27b.config.json").read_text())
    assert int4_rows.matrices(cfg) == {"wqkv": (14336, 5120), "wo": (5120, 6144), "w_in": (16480, 5120),
                                       "w_out": (5120, 6144), "w13": (34816, 5120), "w2": (5120, 17408)}
    assert int4_rows._configs("64,128,4,1,1; 16,128,4,4,0") == [(64, 128, 4, 1, 1), (16, 128, 4, 4, 0)]
    assert int4_rows._rows("1,8,16") == [1, 8, 16]
    with pytest.raises(SystemExit):
        int4_rows.main(["--rows", "17"])
    with pytest.raises(SystemExit):
        int4_rows.main(["--configs", "64,128,4,1,2"])
    assert int4_rows.main(["--matrices", "w13,lm_head"]) == 2
    if not torch.cuda.is_available():
        assert int4_rows.main(["--rows", "1,8", "--matrices", "w2"]) == 4
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_bench_summary_weighs_each_matrix_by_its_bytes_and_prints_every_row_count():
    """summary / table on a made-up document (no timing here): per M, all bytes over all us, against the M = 1 GEMV's."""
    from engine.bench import int4_rows

    def entry(us, m1_us, nbytes):
        return {**int4_rows._entry(nbytes, us, 1000.0, nbytes / (m1_us * 1e-6) / 1e9), "rel_err": 0.001}

    doc = {"device": "made up", "read_bw_gbps": 1000.0, "dtype": "bfloat16", "group_size": 128, "matrices": {}}
    for name, nbytes, m1_us in (("a", 10 ** 6, 2.0), ("b", 3 * 10 ** 6, 4.0)):
        doc["matrices"][name] = {"n": 8, "k": 8, "bytes": nbytes, "m1_gemv": int4_rows._entry(nbytes, m1_us, 1000.0, None),
                                 "rows": {"1": {"blocks": [64, 128, 4, 1, 1], **entry(m1_us, m1_us, nbytes)},
                                          "8": {"blocks": [64, 128, 4, 1, 1], **entry(2 * m1_us, m1_us, nbytes)}},
                                 "dequant_linear": {"rows": 8, **entry(10 * m1_us, m1_us, nbytes)}}
    s = int4_rows.summary(doc, 1000.0)
    assert s["m1_fraction_of_read"] == round(4e6 / 6e-6 / 1e9 / 1000.0, 4)
    assert s["rows"]["1"]["vs_m1"] == 1.0 and s["m8_vs_m1"] == 0.5 and s["rows"]["8"]["us"] == 12.0
    doc["summary"] = s
    text = int4_rows.table(doc)
    assert "rows M= 8" in text and "dequantise + F.linear M=8" in text and "0.500 x M=1" in text
