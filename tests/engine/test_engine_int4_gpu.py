"""GPTQ / AWQ weights on a GPU (pytest -m gpu on the device): the int4 GEMV and its prologues against
dequantise-then-matmul in bf16 and fp16 (the V100's dtype), and a packed checkpoint served through the fused kernels
and CUDA graphs giving transformers' greedy tokens on the dequantised weights (float32, so the tokens can be equal).
CPU checks of the same kernels: tests/engine/test_engine_int4_kernels.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.core import quant

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
    from engine.core import gemv, gemv_int4
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
    y, x_new = gemv.linear_norm(x, d, nw, 1e-6, w)  # dispatches to the int4 kernel
    assert rel(y, F.linear(rms_norm(x + d, nw, 1e-6).float(), wd)) < 1e-2 and torch.equal(x_new, x + d)
    gu = torch.randn(1, 1, 2 * k, device="cuda").to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    assert rel(gemv.linear_silu(gu, w), F.linear((F.silu(gate) * up).float(), wd)) < 1e-2
    assert torch.equal(gemv_int4.dequantise(w, torch.float32), w.dequantise_held(torch.float32))
    chunk = torch.randn(1, 64, k, device="cuda").to(dtype)  # a prefill chunk: dequantised, then cuBLAS
    assert rel(w.linear(chunk), F.linear(chunk.float(), wd)) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fp16_pairs_assembly_matches_dequantise_then_matmul_at_any_activation_scale(dtype):
    """On a GPU the pairs form runs its inline PTX (LOP3 nibble pairs, f16x2 arithmetic, an fp16x2 partial per
    word): against dequantise-then-matmul and the float32-planes form, for activations of order 1 and 3000
    (fp16 products of unscaled h would overflow), GPTQ (zero offset 1) and AWQ (0), split-K and not."""
    from engine.core import gemv, gemv_int4

    g = torch.Generator().manual_seed(7)
    n, k = 5120, 2048
    for zoff in (1, 0):
        w = _packed(n, k, g, zoff)
        wd = w.dequantise(torch.float32)
        for scale in (1.0, 3000.0):
            x = (scale * torch.randn(k, device="cuda")).to(dtype)
            want = F.linear(x.float(), wd)
            outs = {}
            for blocks in ((32, 128, 1, 8, 1, 1), (128, 128, 4, 1, 2, 1), (64, 128, 2, 4, 4, 1), (32, 128, 1, 8, 2, 0)):
                out = torch.full((n,), float("nan"), device="cuda", dtype=dtype)
                gemv_int4.launch(gemv.PROLOGUE_PLAIN, x, w, None, out, blocks=blocks)
                assert torch.isfinite(out).all() and rel(out, want) < 1e-2, (zoff, scale, blocks)
                outs[blocks] = out
            pairs, planes = outs[(32, 128, 1, 8, 1, 1)], outs[(32, 128, 1, 8, 2, 0)]
            assert rel(pairs, planes) < 1e-2 and rel(outs[(128, 128, 4, 1, 2, 1)], pairs) < 1e-2
            assert rel(outs[(64, 128, 2, 4, 4, 1)], pairs) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [5120, 5112])  # 5112: a partial row block (and tiles of 32 rows cannot hold it)
def test_the_subnormal_pairs_assembly_matches_dequantise_then_matmul_at_any_activation_scale(dtype, n):
    """FORM_SUBN on the card (nibbles read as fp16 subnormals by HFMA2, the zero points once a word, four words'
    sums chained in fp16): against dequantise-then-matmul and the pairs form, activations of order 1e-3, 1 and
    3000, GPTQ (zero offset 1) and AWQ (0), split-K or not, prefetching or not, words in rows and in tiles, and
    the norm and SiLU prologues."""
    from engine.core import gemv, gemv_int4
    from engine.core.model import rms_norm

    g = torch.Generator().manual_seed(9)
    k = 2048
    for zoff in (1, 0):
        w = _packed(n, k, g, zoff)
        wd = w.dequantise(torch.float32)
        t = gemv_int4.held(w, torch.device("cuda"))
        tq = w.tiled(32, quads=True)
        for scale in (1e-3, 1.0, 3000.0):
            x = (scale * torch.randn(k, device="cuda")).to(dtype)
            want = F.linear(x.float(), wd)
            pairs = torch.empty(n, device="cuda", dtype=dtype)
            gemv_int4.launch(gemv.PROLOGUE_PLAIN, x, t, None, pairs, blocks=(64, 128, 4, 4, 2, 1))
            for held in (w, t, tq):
                for blocks in ((128, 128, 4, 1, 2, 2), (128, 128, 4, 4, 2, 2), (64, 128, 2, 8, 2, 2),
                               (256, 128, 8, 4, 1, 2)):
                    out = torch.full((n,), float("nan"), device="cuda", dtype=dtype)
                    gemv_int4.launch(gemv.PROLOGUE_PLAIN, x, held, None, out, blocks=blocks)
                    assert torch.isfinite(out).all() and rel(out, want) < 1e-2, (zoff, scale, blocks)
                    assert rel(out, pairs) < 1e-2, (zoff, scale, blocks)
        x, d = torch.randn(k, device="cuda").to(dtype), torch.randn(k, device="cuda").to(dtype)
        nw = (1.0 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
        out, xo = torch.empty(n, device="cuda", dtype=dtype), torch.empty(k, device="cuda", dtype=dtype)
        gemv_int4.launch(gemv.PROLOGUE_NORM, x, t, None, out, d, nw, 1e-6, xo, blocks=(128, 128, 4, 4, 2, 2))
        assert torch.equal(xo, x + d) and rel(out, F.linear(rms_norm(x + d, nw, 1e-6).float(), wd)) < 1e-2
        gu = torch.randn(2 * k, device="cuda").to(dtype)
        gemv_int4.launch(gemv.PROLOGUE_SILU, gu, t, None, out, blocks=(128, 128, 4, 4, 2, 2))
        assert rel(out, F.linear((F.silu(gu[:k].float()) * gu[k:].float()), wd)) < 1e-2


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


@pytest.mark.parametrize("form", [1, 2])  # the pairs form (3-stage pipeline), the subnormal pairs (tile ahead)
def test_split_k_sums_are_the_same_on_every_graph_replay(form):
    """Split-K: the last program of a row block adds the slices in slice order, so the result does not depend on
    which program finishes last; the arrival counters are left at zero for the next replay."""
    from engine.core import gemv, gemv_int4

    g = torch.Generator().manual_seed(4)
    n, k = 5120, 8704
    w = quant.PackedLinear(quant.pack(torch.randint(0, 16, (n, k), generator=g)),
                           quant.pack(torch.randint(0, 16, (k // 128, n), generator=g)),
                           (0.001 + 0.002 * torch.rand(k // 128, n, generator=g)).half(), None, 128, 1, "t").to("cuda")
    gu = torch.randn(2 * k, device="cuda").to(torch.bfloat16)
    ref = F.linear((F.silu(gu[:k].float()) * gu[k:].float()), w.dequantise(torch.float32))
    outs = []
    for split in (1, 4, 8):
        blocks = (128, 128, 4, split, 3, 1) if form == 1 else (128, 128, 4, split, 2, 2)
        out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        gemv_int4.launch(gemv.PROLOGUE_SILU, gu, w, None, out, blocks=blocks)  # counters made
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemv_int4.launch(gemv.PROLOGUE_SILU, gu, w, None, out, blocks=blocks)
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
    """quant.PackedLinear.tiled on the card (the inline PTX, cp.async pipelines, 16-byte loads): bit-identical to
    the row layout for every loop form and a row block under and over the held tile, and the prefill dequantise
    the same matrix."""
    from engine.core import gemv, gemv_int4

    g = torch.Generator().manual_seed(8)
    n, k = 5120, 4096
    w = quant.PackedLinear(quant.pack(torch.randint(0, 16, (n, k), generator=g)),
                           quant.pack(torch.randint(0, 16, (k // 128, n), generator=g)),
                           (0.001 + 0.002 * torch.rand(k // 128, n, generator=g)).half(), None, 128, 1, "t").to("cuda")
    t = gemv_int4.held(w, torch.device("cuda"))
    assert t.tile_rows == gemv_int4.TILE_ROWS > 0
    x = torch.randn(k, device="cuda").to(dtype)
    q = w.tiled(32, quads=True)  # each tile's words in quads of four
    assert q.tile_quads and torch.equal(q.row_words(), w.qweight)
    for blocks in ((32, 128, 1, 4, 1, 1), (32, 128, 1, 8, 2, 1), (16, 128, 1, 8, 4, 1), (64, 128, 2, 8, 2, 1),
                   (128, 128, 4, 4, 3, 1), (64, 128, 2, 8, 2, 0), (128, 128, 4, 4, 2, 2), (32, 128, 1, 8, 2, 2)):
        want, got = torch.empty(n, device="cuda", dtype=dtype), torch.empty(n, device="cuda", dtype=dtype)
        gemv_int4.launch(gemv.PROLOGUE_PLAIN, x, w, None, want, blocks=blocks)
        gemv_int4.launch(gemv.PROLOGUE_PLAIN, x, t, None, got, blocks=blocks)
        assert torch.equal(got, want), blocks
        gemv_int4.launch(gemv.PROLOGUE_PLAIN, x, q, None, got, blocks=blocks)
        assert torch.equal(got, want), ("quads", blocks)
    assert torch.equal(gemv_int4.dequantise(t, torch.float32), w.dequantise_held(torch.float32))
    assert torch.equal(gemv_int4.dequantise(q, torch.float32), w.dequantise_held(torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs compute capability 9.0")
@pytest.mark.parametrize("form", [1, 2])  # the pairs form, the subnormal pairs (their first words prefetched)
def test_the_gemv_launched_during_its_row_kernel_reads_this_calls_input_on_every_replay(monkeypatch, form):
    """PDL (gemv_int4.pdl_enabled): the GEMV starts while the row kernel still writes h. A chain of two products
    in one graph (norm + gate/up, then SiLU + down of its output), the input changed before every replay: each
    replay's outputs equal, bit for bit, the same products launched one after another without PDL. A GEMV that
    read h before the row kernel finished would give the previous replay's answer."""
    from engine.core import gemv, gemv_int4

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
        gemv_int4.launch(gemv.PROLOGUE_NORM, x, w13, None, gu, d, nw, 1e-6, xo,
                         blocks=(*gemv_int4._default_blocks(2 * inter, k)[:5], form))
        gemv_int4.launch(gemv.PROLOGUE_SILU, gu, w2, None, y, blocks=(*gemv_int4._default_blocks(k, inter)[:5], form))

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
    monkeypatch.setenv(gemv_int4.PDL_ENV, "0")
    assert not gemv_int4.pdl_enabled(torch.device("cuda"))
    for v, (gu_pdl, y_pdl) in zip(inputs, got):
        x.copy_(v)
        chain()
        torch.cuda.synchronize()
        assert torch.equal(gu, gu_pdl) and torch.equal(y, y_pdl)
    assert not torch.equal(got[0][1], got[1][1])  # the inputs differ, so do the answers: the check can fail


@pytest.mark.parametrize("form", [1, 2])
def test_a_persistent_grid_gives_the_ordinary_grids_answer_on_every_replay(form):
    """blocks[6] = programs a multiprocessor: a grid of fewer programs than (row block, slice) items, each
    looping over items, gives the one-program-an-item answer bit for bit, in a graph replayed 10 times (the
    split-K counters left at zero by every call)."""
    from engine.core import gemv, gemv_int4

    g = torch.Generator().manual_seed(10)
    n, k = 34816, 5120  # the 27B gate/up: 544 row blocks of 64 x 4 slices, more items than 8 programs an SM
    w = gemv_int4.held(_packed(n, k, g), "cuda")
    x = torch.randn(k, device="cuda").bfloat16()
    blocks = (64, 128, 4, 4, 2, form)
    want = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    gemv_int4.launch(gemv.PROLOGUE_PLAIN, x, w, None, want, blocks=blocks)
    for per_sm in (4, 8):
        out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        gemv_int4.launch(gemv.PROLOGUE_PLAIN, x, w, None, out, blocks=(*blocks, per_sm))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemv_int4.launch(gemv.PROLOGUE_PLAIN, x, w, None, out, blocks=(*blocks, per_sm))
        for _ in range(10):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want), per_sm


def test_two_tiles_ahead_gives_the_one_tile_ahead_answer_on_the_gpu():
    """AHEAD2 (blocks[4] = 5): the pairs form with two tiles' loads in flight in registers sums the same tiles in
    the same order as one tile ahead: the same bits, with every prologue, split-K or not, PDL on where it is."""
    from engine.core import gemv, gemv_int4

    g = torch.Generator().manual_seed(12)
    n, k = 12288, 5120
    w = gemv_int4.held(_packed(n, k, g), "cuda")
    x, d = torch.randn(k, device="cuda").bfloat16(), torch.randn(k, device="cuda").bfloat16()
    nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    for bn, warps, split in ((64, 4, 4), (128, 8, 1), (32, 2, 8)):
        a, b = torch.empty(n, device="cuda", dtype=torch.bfloat16), torch.empty(n, device="cuda", dtype=torch.bfloat16)
        xa, xb = torch.empty(k, device="cuda", dtype=torch.bfloat16), torch.empty(k, device="cuda", dtype=torch.bfloat16)
        gemv_int4.launch(gemv.PROLOGUE_NORM, x, w, None, a, d, nw, 1e-6, xa, blocks=(bn, 128, warps, split, 2, 1))
        gemv_int4.launch(gemv.PROLOGUE_NORM, x, w, None, b, d, nw, 1e-6, xb,
                         blocks=(bn, 128, warps, split, gemv_int4.AHEAD2, 1))
        assert torch.equal(a, b) and torch.equal(xa, xb), (bn, warps, split)
