"""Cases run by tests/engine/test_engine_int4_rows.py in a child pytest under Triton's interpreter (TRITON_INTERPRET=1
before triton is first imported: hence a process of its own; the file name keeps the main run from collecting it).

engine/kernels/gemv_int4.py's batched GEMV (launch_rows / linear_rows: M = 1..16 rows of x through one packed matrix,
each weight word read once) on GPTQ and AWQ matrices packed the way AutoGPTQ and AutoAWQ write them
(tests/quant_helpers.py) and loaded as the engine loads them (quant.from_checkpoint), against
  - the reference: the checkpoint dequantised in float32 by the writers' rule (quant_helpers.dequantise), then
    F.linear in float32, rounded once to the output's dtype. Bound per output: |got - ref| <= half a unit in the last
    place of the dtype (2^-8 |ref| for bf16, 2^-11 for fp16, 0 for float32) + 1e-6 x (|x| @ |W|^T + |b|): the
    kernel sums the same exact products (q - z) x in float32 in another order (tiles, tl.dot or broadcast FMAs,
    split-K slices), whose difference is a few float32 roundings of the sum of magnitudes at these K (<= 512);
  - the M = 1 GEMV (gemv_int4.launch, plain prologue) on each row alone: the same bound between the two, doubled (each
    is within it of the float32 sum), i.e. the two differ at most by one rounding step where their float32 sums
    straddle a rounding boundary, and are equal elsewhere.
Both forms (DOT: tl.dot, run in float32 here; FMA: broadcast multiply-adds), split-K in one and two slices, words in
rows and in tiles of 32 rows, a desc_act input order (GPTQ g_idx), a bias, a masked tail along K and along N."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from engine.core import quant, quant_config
from tests import quant_helpers as qh

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/engine/test_engine_int4_rows.py with TRITON_INTERPRET=1", allow_module_level=True)

HALF_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
SUM_ORDER = 1e-6  # float32 sums of the same products in another order: a few roundings (2^-24) of the magnitudes


def checkpoint(method: str, n: int, k: int, group: int, desc_act: bool, g) -> tuple[quant.PackedLinear, torch.Tensor]:
    """A random [n, k] matrix quantised and packed as the method's writer packs it, loaded by the engine; and its
    float32 weight by the writers' dequantisation (module input order)."""
    w = 0.08 * torch.randn(n, k, generator=g)
    order = torch.randperm(k, generator=g) if desc_act else None
    g_idx = qh._group_index(k, group, order)
    q, zeros, scales = qh.quantise(w, g_idx, sym=False, min_zero=1 if method == "gptq" else 0)
    parts = qh.pack_gptq(q, zeros, scales, g_idx) if method == "gptq" else qh.pack_awq(q, zeros, scales)
    raw = ({"quant_method": "gptq", "bits": 4, "group_size": group, "sym": False, "desc_act": desc_act}
           if method == "gptq" else {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm"})
    p = quant.from_checkpoint(quant_config.parse(raw), parts, "test")
    assert (p.perm is not None) == desc_act
    return p, qh.dequantise(q, zeros, scales, g_idx)


def within(got: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, dtype, factor: float = 1.0) -> None:
    """|got - ref| <= factor (half an ulp of dtype x |ref| + SUM_ORDER x mag), elementwise."""
    err = (got.float() - ref.float()).abs()
    bound = factor * (HALF_ULP[dtype] * ref.float().abs() + SUM_ORDER * mag)
    worst = float((err - bound).max())
    assert worst <= 0, f"exceeds the bound by {worst:.3g} (max error {float(err.max()):.3g})"


def one_row(x: torch.Tensor, w, b) -> torch.Tensor:
    """The M = 1 GEMV on each row of x alone (its default form for the dtype: fp16 pairs for 16-bit, planes else)."""
    from engine.kernels import decode, gemv_int4

    rows = []
    for r in x:
        out = torch.full((w.out_features,), float("nan"), dtype=x.dtype)
        gemv_int4.launch(decode.PROLOGUE_PLAIN, r.contiguous(), w, b, out, blocks=(32, 128, 4, 1, 2))
        rows.append(out)
    return torch.stack(rows)


@pytest.mark.parametrize("m", [2, 3, 8, 16])
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_batched_rows_match_dequantise_then_matmul_and_the_one_row_gemv(m, method):
    from engine.kernels import gemv_int4

    g = torch.Generator().manual_seed(100 * m + len(method))
    n, k, group = 64, 256, 64
    layouts = [(False, False), (False, True)] + ([(True, False), (True, True)] if method == "gptq" else [])
    for desc_act, tiles in layouts:
        w, wd = checkpoint(method, n, k, group, desc_act, g)
        if tiles:
            w = w.tiled(32)
            assert w.tile_rows == 32
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=g).to(dtype)
            b = (0.1 * torch.randn(n, generator=g)).to(dtype)
            ref = F.linear(x.float(), wd, b.float())
            mag = F.linear(x.float().abs(), wd.abs(), b.float().abs())
            got = {}
            for form in (gemv_int4.ROWS_DOT, gemv_int4.ROWS_FMA):
                for split in (1, 2):  # split 2 with its next tile loaded ahead (stages 2)
                    out = torch.full((m, n), float("nan"), dtype=dtype)
                    gemv_int4.launch_rows(x, w, b, out, blocks=(32, 64, 4, split, form, split))
                    within(out, ref, mag, dtype)
                    got[form, split] = out
            if (desc_act, tiles) == layouts[-1]:  # each row against the M = 1 kernel on that row alone (its
                # launches are the slow part under the interpreter: on the richest layout only)
                want = one_row(x, w, b)
                within(got[gemv_int4.ROWS_DOT, 1], want, mag, dtype, factor=2.0)
                within(got[gemv_int4.ROWS_FMA, 2], want, mag, dtype, factor=2.0)
                if dtype is torch.bfloat16:  # rounded once from float32 sums a few ulps apart: mostly equal
                    assert float((got[gemv_int4.ROWS_DOT, 1] == want).float().mean()) >= 0.9
            if dtype is torch.bfloat16:  # and mostly equal to it, and to the reference rounded once
                assert float((got[gemv_int4.ROWS_DOT, 1] == ref.to(dtype)).float().mean()) >= 0.9


def test_a_masked_tail_along_k_and_n_one_group_and_groups_of_32():
    """K = 200 in one group (-1: a tile past K is masked), N = 40 under row blocks of 32 (a masked block), no bias;
    and groups of 32 (tiles of 32 inputs, the least tl.dot takes); each tile's loads then its sums, and the next
    tile loaded ahead (the slice's last tile loaded again, never summed)."""
    from engine.kernels import gemv_int4

    g = torch.Generator().manual_seed(7)
    for n, k, group in ((40, 200, -1), (48, 128, 32)):
        w, wd = checkpoint("gptq", n, k, group, False, g)
        for m in (2, 5):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k, generator=g).to(dtype)
                ref = F.linear(x.float(), wd)
                mag = F.linear(x.float().abs(), wd.abs())
                for form in (gemv_int4.ROWS_DOT, gemv_int4.ROWS_FMA):
                    for split, stages in ((1, 1), (2, 1), (1, 2), (2, 2)):  # stages 2: a masked tile ahead
                        out = torch.full((m, n), float("nan"), dtype=dtype)
                        gemv_int4.launch_rows(x, w, None, out, blocks=(32, 128, 4, split, form, stages))
                        within(out, ref, mag, dtype)


@pytest.mark.parametrize("zoff_method", ["gptq", "awq"])
def test_fp16_activations_of_any_scale(zoff_method):
    """fp16 (the V100's dtype): the DOT form's q - z made from fp16 bits (1024 + q), activations of order 1 and 3000
    (products and sums far past fp16's range stay float32), GPTQ's zero offset 1 and AWQ's 0."""
    from engine.kernels import gemv_int4

    g = torch.Generator().manual_seed(11)
    w, wd = checkpoint(zoff_method, 64, 256, 128, False, g)
    assert w.zero_offset == (1 if zoff_method == "gptq" else 0)
    for scale in (1.0, 3000.0):
        x = (scale * torch.randn(4, 256, generator=g)).to(torch.float16)
        ref = F.linear(x.float(), wd)
        mag = F.linear(x.float().abs(), wd.abs())
        for form in (gemv_int4.ROWS_DOT, gemv_int4.ROWS_FMA):
            out = torch.full((4, 64), float("nan"), dtype=torch.float16)
            gemv_int4.launch_rows(x, w, None, out, blocks=(32, 128, 4, 2, form))
            assert torch.isfinite(out).all()
            within(out, ref, mag, torch.float16)


def test_linear_rows_takes_any_leading_shape_with_the_default_blocks_and_is_deterministic():
    """x [B, 1, K] (decode_batch's rows) -> [B, 1, N]; the default blocks (_rows_default_blocks: DOT for 16-bit,
    FMA for float32); the same output twice (fixed reduction order, split-K included)."""
    from engine.kernels import gemv_int4

    g = torch.Generator().manual_seed(13)
    w, wd = checkpoint("awq", 128, 512, 128, False, g)
    for dtype in (torch.float32, torch.bfloat16):
        blocks = gemv_int4._rows_default_blocks(128, 512, 6, dtype, torch.device("cpu"))
        assert blocks[4] == (gemv_int4.ROWS_DOT if dtype is torch.bfloat16 else gemv_int4.ROWS_FMA) and blocks[3] > 1
        x = torch.randn(6, 1, 512, generator=g).to(dtype)
        b = torch.randn(128, generator=g).to(dtype)
        y = gemv_int4.linear_rows(x, w, b)
        assert y.shape == (6, 1, 128) and y.dtype == dtype
        within(y.view(6, 128), F.linear(x.view(6, 512).float(), wd, b.float()),
               F.linear(x.view(6, 512).float().abs(), wd.abs(), b.float().abs()), dtype)
        assert torch.equal(gemv_int4.linear_rows(x, w, b), y)


def test_rows_past_the_batch_limit_and_bad_blocks_are_refused():
    from engine.kernels import gemv_int4

    g = torch.Generator().manual_seed(17)
    w, _ = checkpoint("gptq", 32, 128, 32, False, g)
    with pytest.raises(ValueError, match="rows"):
        gemv_int4.launch_rows(torch.randn(17, 128), w, None, torch.empty(17, 32))
    with pytest.raises(ValueError, match="form"):
        gemv_int4.launch_rows(torch.randn(2, 128), w, None, torch.empty(2, 32), blocks=(32, 32, 4, 1, 5))
    with pytest.raises(ValueError, match="nest"):
        gemv_int4.launch_rows(torch.randn(2, 128), w, None, torch.empty(2, 32), blocks=(32, 4, 4, 1, 0))
    with pytest.raises(ValueError, match="stages"):
        gemv_int4.launch_rows(torch.randn(2, 128), w, None, torch.empty(2, 32), blocks=(32, 32, 4, 1, 0, 3))


def test_up_to_one_row_upto_rows_run_as_one_row_gemvs(monkeypatch):
    """linear_rows with ONE_ROW_UPTO 3: three rows are three one-row GEMVs (equal to each row alone, bit for bit),
    four rows the batched GEMV."""
    from engine.kernels import gemv_int4

    g = torch.Generator().manual_seed(19)
    w, wd = checkpoint("gptq", 64, 256, 64, False, g)
    monkeypatch.setattr(gemv_int4, "ONE_ROW_UPTO", [3])
    calls = []
    real = gemv_int4.launch_rows
    monkeypatch.setattr(gemv_int4, "launch_rows", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    for m in (3, 4):
        x = torch.randn(m, 256, generator=g).to(torch.bfloat16)
        y = gemv_int4.linear_rows(x, w)
        for r in range(m if m == 3 else 0):  # the routed rows: each its one-row GEMV, bit for bit
            alone = torch.empty(64, dtype=torch.bfloat16)
            gemv_int4.launch(gemv_int4.PROLOGUE_PLAIN, x[r].contiguous(), w, None, alone)
            assert torch.equal(y[r], alone)
        within(y, F.linear(x.float(), wd), F.linear(x.float().abs(), wd.abs()), torch.bfloat16)
    assert calls == [4]
