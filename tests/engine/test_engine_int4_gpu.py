"""GPTQ / AWQ weights on a GPU (pytest -m gpu on the device): the int4 GEMV and its prologues against
dequantise-then-matmul in bf16 and fp16 (the V100's dtype), and a packed checkpoint served through the fused kernels
and CUDA graphs giving transformers' greedy tokens on the dequantised weights (float32, so the tokens can be equal).
CPU checks of the same kernels: tests/engine/test_engine_int4_kernels.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.core import quant
from engine.kernels import decode, gemv_int4

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _packed(n: int, k: int, g, zoff: int = 1) -> quant.PackedLinear:
    """A random [n, k] matrix packed in groups of 128 on the GPU, in the row layout."""
    return quant.PackedLinear(quant.pack(torch.randint(0, 16, (n, k), generator=g)),
                              quant.pack(torch.randint(0, 16, (k // 128, n), generator=g)),
                              (0.001 + 0.002 * torch.rand(k // 128, n, generator=g)).half(), None, 128, zoff,
                              "t").to("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [32, 128, -1])
def test_int4_gemv_on_the_gpu_matches_dequantise_then_matmul(dtype, group):
    from engine.core.model import rms_norm

    g = torch.Generator().manual_seed(3)
    n, k = 5120, 2048
    gs = k if group == -1 else group
    w = quant.PackedLinear(quant.pack(torch.randint(0, 16, (n, k), generator=g)),
                           quant.pack(torch.randint(0, 16, (k // gs, n), generator=g)),
                           (0.001 + 0.002 * torch.rand(k // gs, n, generator=g)).half(), None, group, 1, "t").to("cuda")
    wd = w.dequantise(torch.float32)
    x, d = torch.randn(1, 1, k, device="cuda").to(dtype), torch.randn(1, 1, k, device="cuda").to(dtype)
    nw = torch.ones(k, device="cuda", dtype=dtype)
    assert rel(w.linear(x), F.linear(x.float(), wd)) < 1e-2
    y, x_new = decode.linear_norm(x, d, nw, 1e-6, w)  # dispatches to the int4 kernel
    assert rel(y, F.linear(rms_norm(x + d, nw, 1e-6).float(), wd)) < 1e-2 and torch.equal(x_new, x + d)
    gu = torch.randn(1, 1, 2 * k, device="cuda").to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    assert rel(decode.linear_silu(gu, w), F.linear((F.silu(gate) * up).float(), wd)) < 1e-2
    assert torch.equal(gemv_int4.dequantise(w, torch.float32), w.dequantise_held(torch.float32))
    chunk = torch.randn(1, 64, k, device="cuda").to(dtype)  # a prefill chunk: dequantised, then cuBLAS
    assert rel(w.linear(chunk), F.linear(chunk.float(), wd)) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fp16_pairs_assembly_matches_dequantise_then_matmul_at_any_activation_scale(dtype):
    """On a GPU the pairs form runs its inline PTX (LOP3 nibble pairs, f16x2 arithmetic, an fp16x2 partial per
    word): against dequantise-then-matmul and the float32-planes form, for activations of order 1 and 3000
    (fp16 products of unscaled h would overflow), GPTQ (zero offset 1) and AWQ (0), split-K and not."""
    g = torch.Generator().manual_seed(7)
    n, k = 5120, 2048
    for zoff in (1, 0):
        w = _packed(n, k, g, zoff)
        wd = w.dequantise(torch.float32)
        for scale in (1.0, 3000.0):
            x = (scale * torch.randn(k, device="cuda")).to(dtype)
            want = F.linear(x.float(), wd)
            outs = {}
            for blocks in ((32, 128, 1, 8, 1, 1), (128, 128, 4, 1, 2, 1), (64, 128, 2, 4, 1, 1), (32, 128, 1, 8, 2, 0)):
                out = torch.full((n,), float("nan"), device="cuda", dtype=dtype)
                gemv_int4.launch(decode.PROLOGUE_PLAIN, x, w, None, out, blocks=blocks)
                assert torch.isfinite(out).all() and rel(out, want) < 1e-2, (zoff, scale, blocks)
                outs[blocks] = out
            pairs, planes = outs[(32, 128, 1, 8, 1, 1)], outs[(32, 128, 1, 8, 2, 0)]
            assert rel(pairs, planes) < 1e-2 and rel(outs[(128, 128, 4, 1, 2, 1)], pairs) < 1e-2
            assert rel(outs[(64, 128, 2, 4, 1, 1)], pairs) < 1e-2


def _served_tokens_are_transformers(hf, d, method: str, prompt: list[int]) -> None:
    """The checkpoint in ``d`` on the GPU (float32, the fused kernels, CUDA graphs) gives hf's 24 greedy tokens."""
    from engine.core import config as ecfg
    from engine.core import runner, weights
    from engine.core.model import Model
    from engine.core.sampling import Sampler
    from tests.quant_helpers import greedy

    want = greedy(hf, prompt, 24)
    model = Model(ecfg.load(d), dtype=torch.float32, device="cuda")
    weights.load_into(model, d)
    model.setup_cache(256)
    dec = runner.prepare(model)
    assert dec.kernels == "fused" and dec.graphs and dec.info["weights"]["format"].startswith(method)
    out, _ = runner.run(model, prompt, 24, Sampler(), set(), chunk=4)
    assert out == want


@pytest.mark.parametrize("method,group", [("gptq", 128), ("awq", 64)])
def test_a_packed_checkpoint_on_the_gpu_gives_transformers_tokens(method, group, tmp_path):
    from tests.quant_helpers import make_quantised

    hf, _ = make_quantised("llama-3.1-8b", tmp_path, method, group, sym=False)
    _served_tokens_are_transformers(hf, tmp_path, method, [1, 17, 300, 42, 5, 99])


@pytest.mark.parametrize("form", [0, 1])  # the planes form, the pairs form (each a tile ahead)
def test_split_k_sums_are_the_same_on_every_graph_replay(form):
    """Split-K: the last program of a row block adds the slices in slice order, so the result does not depend on
    which program finishes last; the arrival counters are left at zero for the next replay."""
    g = torch.Generator().manual_seed(4)
    n, k = 5120, 8704
    w = quant.PackedLinear(quant.pack(torch.randint(0, 16, (n, k), generator=g)),
                           quant.pack(torch.randint(0, 16, (k // 128, n), generator=g)),
                           (0.001 + 0.002 * torch.rand(k // 128, n, generator=g)).half(), None, 128, 1, "t").to("cuda")
    gu = torch.randn(2 * k, device="cuda").to(torch.bfloat16)
    ref = F.linear((F.silu(gu[:k].float()) * gu[k:].float()), w.dequantise(torch.float32))
    outs = []
    for split in (1, 4, 8):
        blocks = (128, 128, 4, split, 2, form)
        out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        gemv_int4.launch(decode.PROLOGUE_SILU, gu, w, None, out, blocks=blocks)  # counters made
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemv_int4.launch(decode.PROLOGUE_SILU, gu, w, None, out, blocks=blocks)
        first = None
        for _ in range(20):
            graph.replay()
            torch.cuda.synchronize()
            first = out.clone() if first is None else first
            assert torch.equal(out, first), split
        assert rel(out, ref) < 1e-2, split
        outs.append(first)
    assert rel(outs[1], outs[0]) < 1e-2 and rel(outs[2], outs[0]) < 1e-2


@pytest.mark.parametrize("key", ["gptq-sym-g32", "awq-g64-all-packed"])
def test_a_packed_gdn_checkpoint_on_the_gpu_gives_transformers_tokens(key, tmp_path):
    """Qwen3.5 with its Gated DeltaNet projections packed (w_in packed beside dense b/a, or all one packed matrix):
    the fused kernels and CUDA graphs give transformers' greedy tokens on the dequantised weights."""
    from tests.engine.test_engine_gdn_packed import CASES, PROMPT, make_hybrid

    method, group, sym, dense, override = CASES[key]
    hf, _ = make_hybrid(tmp_path, method, group, sym, dense, override)
    _served_tokens_are_transformers(hf, tmp_path, method, PROMPT)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_words_held_in_tiles_give_the_row_layouts_outputs_on_the_gpu(dtype):
    """quant.PackedLinear.tiled on the card (the inline PTX, 16-byte loads): bit-identical to
    the row layout for every loop form and a row block under and over the held tile, and the prefill dequantise
    the same matrix."""
    g = torch.Generator().manual_seed(8)
    n, k = 5120, 4096
    w = quant.PackedLinear(quant.pack(torch.randint(0, 16, (n, k), generator=g)),
                           quant.pack(torch.randint(0, 16, (k // 128, n), generator=g)),
                           (0.001 + 0.002 * torch.rand(k // 128, n, generator=g)).half(), None, 128, 1, "t").to("cuda")
    t = gemv_int4.held(w, torch.device("cuda"))
    assert t.tile_rows == gemv_int4.TILE_ROWS > 0
    x = torch.randn(k, device="cuda").to(dtype)
    for blocks in ((32, 128, 1, 4, 1, 1), (32, 128, 1, 8, 2, 1), (16, 128, 1, 8, 1, 1), (64, 128, 2, 8, 2, 1),
                   (128, 128, 4, 4, 2, 1), (64, 128, 2, 8, 2, 0), (128, 128, 4, 4, 1, 0)):
        want, got = torch.empty(n, device="cuda", dtype=dtype), torch.empty(n, device="cuda", dtype=dtype)
        gemv_int4.launch(decode.PROLOGUE_PLAIN, x, w, None, want, blocks=blocks)
        gemv_int4.launch(decode.PROLOGUE_PLAIN, x, t, None, got, blocks=blocks)
        assert torch.equal(got, want), blocks
    assert torch.equal(gemv_int4.dequantise(t, torch.float32), w.dequantise_held(torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs compute capability 9.0")
@pytest.mark.parametrize("form", [0, 1])  # the planes form, the pairs form (its first words fetched early)
def test_the_gemv_launched_during_its_row_kernel_reads_this_calls_input_on_every_replay(monkeypatch, form):
    """PDL (gemv_int4.pdl_enabled): the GEMV starts while the row kernel still writes h. A chain of two products
    in one graph (norm + gate/up, then SiLU + down of its output), the input changed before every replay: each
    replay's outputs equal, bit for bit, the same products launched one after another without PDL. A GEMV that
    read h before the row kernel finished would give the previous replay's answer."""
    assert gemv_int4.pdl_enabled(torch.device("cuda"))
    g = torch.Generator().manual_seed(5)
    k, inter = 2048, 4096

    def packed(n, kk):
        return gemv_int4.held(quant.PackedLinear(
            quant.pack(torch.randint(0, 16, (n, kk), generator=g)), quant.pack(torch.randint(0, 16, (kk // 128, n),
                                                                                              generator=g)),
            (0.001 + 0.002 * torch.rand(kk // 128, n, generator=g)).half(), None, 128, 1, "t").to("cuda"), "cuda")

    w13, w2 = packed(2 * inter, k), packed(k, inter)
    x, d = torch.randn(k, device="cuda").bfloat16(), torch.randn(k, device="cuda").bfloat16()
    nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    gu, y, xo = (torch.empty(2 * inter, device="cuda", dtype=torch.bfloat16),
                 torch.empty(k, device="cuda", dtype=torch.bfloat16), torch.empty(k, device="cuda", dtype=torch.bfloat16))

    def chain():
        gemv_int4.launch(decode.PROLOGUE_NORM, x, w13, None, gu, d, nw, 1e-6, xo,
                         blocks=(*gemv_int4._default_blocks(2 * inter, k)[:5], form))
        gemv_int4.launch(decode.PROLOGUE_SILU, gu, w2, None, y, blocks=(*gemv_int4._default_blocks(k, inter)[:5], form))

    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    inputs = [torch.randn(k, device="cuda").bfloat16() for _ in range(12)]
    got = []
    for v in inputs:
        x.copy_(v)
        graph.replay()
        got.append((gu.clone(), y.clone()))
    torch.cuda.synchronize()
    monkeypatch.setattr(gemv_int4, "_PDL", [True])  # put back after the test
    gemv_int4.use_pdl(False)
    assert not gemv_int4.pdl_enabled(torch.device("cuda"))
    for v, (gu_pdl, y_pdl) in zip(inputs, got):
        x.copy_(v)
        chain()
        torch.cuda.synchronize()
        assert torch.equal(gu, gu_pdl) and torch.equal(y, y_pdl)
    assert not torch.equal(got[0][1], got[1][1])  # the inputs differ, so do the answers: the check can fail



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_batched_int4_gemv_matches_dequantise_then_matmul_and_the_one_row_gemv_on_the_gpu(dtype):
    """PackedLinear.linear with 2..16 rows on a GPU: the batched GEMV (gemv_int4.linear_rows; tl.dot on tensor
    cores for 16-bit activations from sm_80) on words held in tiles, against dequantise-then-matmul in float32 (the
    output's rounding: rel < 4e-3 in 16 bits; float32 sums in another order: 1e-5) and, row by row, against the
    one-row GEMV (whose fp16-pairs form rounds per word in fp16: rel < 4e-3); every blocks form, split-K and the next
    tile loaded ahead (stages 2) the same way; the same output on a second call (fixed reduction order)."""
    from engine.kernels import gemv_int4

    g = torch.Generator().manual_seed(5)
    n, k = 5120, 2048
    w = gemv_int4.held(_packed(n, k, g), torch.device("cuda"))
    assert w.tile_rows == gemv_int4.TILE_ROWS
    wd = w.dequantise(torch.float32)
    b = torch.randn(n, device="cuda").to(dtype)
    tol = 1e-5 if dtype is torch.float32 else 4e-3
    for m in (2, 3, 8, 16):
        x = torch.randn(m, 1, k, device="cuda").to(dtype)
        ref = F.linear(x.float(), wd, b.float())
        y = w.linear(x, b)
        assert y.shape == (m, 1, n) and y.dtype == dtype and rel(y, ref) < tol, m
        assert torch.equal(w.linear(x, b), y)
        for r in range(m):
            assert rel(y[r], w.linear(x[r:r + 1], b)) < max(tol, 4e-3), (m, r)
        for blocks in ((64, 128, 4, 1, 1), (128, 128, 8, 4, 1), (16, 128, 4, 4, 0), (32, 64, 4, 1, 0),
                       (64, 128, 4, 1, 1, 2), (64, 128, 4, 4, 1, 2), (32, 128, 4, 4, 0, 2)):  # stages 2: one ahead
            out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
            gemv_int4.launch_rows(x.view(m, k), w, b, out, blocks=blocks)
            assert rel(out, ref.view(m, n)) < tol, (m, blocks)


def test_a_rows_matrix_of_packed_and_dense_parts_takes_the_batched_gemv_for_its_packed_part_on_the_gpu():
    from engine.kernels import gemv_int4

    g = torch.Generator().manual_seed(6)
    p = gemv_int4.held(_packed(1024, 1024, g), torch.device("cuda"))
    dense = (0.02 * torch.randn(48, 1024, generator=g)).to("cuda", torch.bfloat16)
    rows = quant.Rows([p, dense])
    x = torch.randn(4, 1, 1024, device="cuda").to(torch.bfloat16)
    want = F.linear(x.float(), torch.cat([p.dequantise(torch.float32), dense.float()]))
    got = rows.linear(x)
    assert got.shape == (4, 1, 1072) and rel(got, want) < 4e-3
    assert torch.equal(got[..., :1024], gemv_int4.linear_rows(x, p))
