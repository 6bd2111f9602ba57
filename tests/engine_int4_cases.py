"""Cases run by tests/engine/test_engine_int4_kernels.py in a child pytest under Triton's interpreter (TRITON_INTERPRET=1
before triton is first imported: hence a process of its own; the file name keeps the main run from collecting it).

engine/kernels/gemv_int4.py's kernels on packed weights (engine.core.quant.PackedLinear) against dequantise-then-
matmul: the plain, norm and SiLU prologues, group sizes 32 / 64 / 128 / one group, a desc_act input order, the
send epilogue's tagged words, the prefill dequantisation; and whole decode steps of a GPTQ and an AWQ model through
the fused blocks against the plain blocks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from engine.core import quant
from engine.core.model import rms_norm
from engine.kernels import decode, gemv_int4

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/engine/test_engine_int4_kernels.py with TRITON_INTERPRET=1", allow_module_level=True)

EPS = 1e-6


@pytest.fixture(autouse=True)
def kernels_on_cpu(monkeypatch):
    monkeypatch.setattr(decode, "CPU_KERNELS", True)


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def packed(n: int, k: int, group: int, g, zero_offset: int = 1, desc_act: bool = False) -> quant.PackedLinear:
    gs = k if group == -1 else group
    q = torch.randint(0, 16, (n, k), generator=g)
    z = torch.randint(0, 15, (k // gs, n), generator=g)
    s = (0.01 + 0.02 * torch.rand(k // gs, n, generator=g)).half()
    perm = torch.randperm(k, generator=g).to(torch.int32) if desc_act else None
    return quant.PackedLinear(quant.pack(q), quant.pack(z), s, perm, group, zero_offset, "test")


@pytest.mark.parametrize("group,desc_act,n,k,blocks", [
    (32, False, 96, 256, (32, 128, 4)),  # four groups per tile
    (64, False, 80, 192, (16, 64, 4)),  # a tile per group; K not a multiple of the blocks
    (128, True, 64, 256, (32, 32, 4)),  # four tiles per group, desc_act order
    (-1, False, 48, 200, (16, 64, 4)),  # one group over all 200 inputs, a masked tail
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split,stages", [(1, 2), (2, 2), (2, 1)])  # split-K in two; next tile prefetched or not
def test_int4_gemv_prologues_match_dequantise_then_matmul(group, desc_act, n, k, blocks, dtype, split, stages):
    g = torch.Generator().manual_seed(n + k)
    w = packed(n, k, group, g, desc_act=desc_act)
    wd = w.dequantise(torch.float32)  # the module's weight, its own input order
    b = torch.randn(n, generator=g).to(dtype)
    x, d = torch.randn(k, generator=g).to(dtype), torch.randn(k, generator=g).to(dtype)
    nw = (1.0 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    tol = 1e-5 if dtype is torch.float32 else 1e-2
    out = torch.empty(n, dtype=dtype)
    gemv_int4.launch(decode.PROLOGUE_PLAIN, x, w, b, out, blocks=(*blocks, split, stages))
    assert rel(out, F.linear(x.float(), wd, b.float())) < tol
    xo = torch.empty(k, dtype=dtype)
    gemv_int4.launch(decode.PROLOGUE_NORM, x, w, None, out, d, nw, EPS, xo, blocks=(*blocks, split, stages))
    assert torch.equal(xo, x + d)
    assert rel(out, F.linear(rms_norm(x + d, nw, EPS).float(), wd)) < tol
    gu = torch.randn(2 * k, generator=g).to(dtype)
    gemv_int4.launch(decode.PROLOGUE_SILU, gu, w, None, out, blocks=(*blocks, split, stages))
    gate, up = gu.chunk(2)
    assert rel(out, F.linear((F.silu(gate) * up).float(), wd)) < tol
    again = torch.empty(n, dtype=dtype)
    gemv_int4.launch(decode.PROLOGUE_SILU, gu, w, None, again, blocks=(*blocks, split, stages))
    assert torch.equal(out, again)  # fixed reduction order


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_gemv_16_bit_forms_match_dequantise_then_matmul_at_any_activation_scale(dtype):
    """16-bit activations: the fp16-pairs form (h scaled per tile by a power of two into fp16, the zero point
    taken off as fp16 pairs) and the float32-planes form against dequantise-then-matmul, for activations of
    order 1 and of order 3000 (without the per-tile scale fp16 products and sums of such h would overflow), with
    both GPTQ's zero offset 1 and AWQ's 0; on the interpreter the pairs form runs its float32 form."""
    g = torch.Generator().manual_seed(11)
    for zoff in (1, 0):
        w = packed(64, 256, 128, g, zero_offset=zoff)
        wd = w.dequantise(torch.float32)
        for scale in (1.0, 3000.0):
            x = (scale * torch.randn(256, generator=g)).to(dtype)
            want = F.linear(x.float(), wd)
            got = {}
            for form, stages in ((gemv_int4.FORM_PAIRS, 1), (gemv_int4.FORM_PAIRS, 2), (gemv_int4.FORM_PLANES, 1)):
                out = torch.full((64,), float("nan"), dtype=dtype)
                gemv_int4.launch(decode.PROLOGUE_PLAIN, x, w, None, out, blocks=(32, 128, 4, 2, stages, form))
                assert torch.isfinite(out).all() and rel(out, want) < 1e-2, (zoff, scale, form, stages)
                got[form, stages] = out
            pairs = got[gemv_int4.FORM_PAIRS, 1]
            assert rel(pairs, got[gemv_int4.FORM_PLANES, 1]) < 1e-2 and torch.equal(pairs, got[gemv_int4.FORM_PAIRS, 2])


def test_the_pairs_row_kernel_writes_fp16_pairs_and_a_power_of_two_per_tile():
    """int4_row_kernel's pairs form: word i's pair p holds h[8 i + p] (low half) and h[8 i + p + 4] (high half)
    times 2^(5 - e) with e = floor(log2 max |h|) over the tile, and the tile's factor is 2^(e - 5)."""
    g = torch.Generator().manual_seed(12)
    k, sub = 256, 128
    w = packed(16, k, 128, g)
    x = (torch.randn(k, generator=g) * torch.tensor([0.01, 500.0]).repeat_interleave(128)).to(torch.bfloat16)
    hp, hf = gemv_int4.row_input(decode.PROLOGUE_PLAIN, x, w, sub, pairs=True)
    bits = hp.view(torch.int32)
    halves = torch.stack([(bits << 16) >> 16, bits >> 16], -1).to(torch.int16).view(torch.float16).float()
    sw = sub // 8
    for c in range(k // sub):
        h = x[c * sub:(c + 1) * sub].float()
        e = torch.floor(torch.log2(h.abs().max()))
        assert float(hf[c]) == float(2.0 ** (e - 5))
        tile = halves[c * sub // 2:(c + 1) * sub // 2].view(4, sw, 2)  # [pair p, word i, half]
        want = torch.stack([h.view(sw, 8)[:, :4].t(), h.view(sw, 8)[:, 4:].t()], -1) * 2.0 ** (5 - e)
        assert torch.equal(tile, want)  # bf16 times a power of two is exact in fp16
        assert 32 <= float(tile.abs().max()) < 64


def test_prefill_dequantise_kernel_is_the_reference_dequantise():
    g = torch.Generator().manual_seed(5)
    for group, zoff in ((32, 1), (128, 0), (-1, 0)):
        w = packed(40, 256, group, g, zero_offset=zoff)
        assert torch.equal(gemv_int4.dequantise(w, torch.float32), w.dequantise_held(torch.float32))
        t = packed(64, 384, group, g, zero_offset=zoff).tiled(32)  # the words held in tiles of 32 rows
        assert t.tile_rows == 32 and torch.equal(gemv_int4.dequantise(t, torch.float32, blocks=(16, 64)),
                                                 t.untiled().dequantise_held(torch.float32))


@pytest.mark.parametrize("n,k,group,desc_act,tb", [
    (64, 256, 128, False, 32),  # two held tiles per row block
    (96, 384, 32, True, 32),  # four groups per held tile, desc_act order; 96 rows: a masked row block at 64
    (128, 256, -1, False, 64),  # one group over all inputs, tiles of 64 rows
    (64, 256, 64, False, 16),  # tiles of 16 rows under row blocks of 32 and 64
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_words_held_in_tiles_give_the_row_layouts_outputs_bit_for_bit(n, k, group, desc_act, tb, dtype):
    """quant.PackedLinear.tiled: the GEMV on the words held in tiles reads the same words and sums them in the
    same order as on rows, for every loop form (no prefetch, one tile ahead; planes and fp16
    pairs), split-K, and row blocks smaller and larger than the held tile."""
    g = torch.Generator().manual_seed(n + k + tb)
    w = packed(n, k, group, g, desc_act=desc_act)
    t = w.tiled(tb)
    assert t.tile_rows == tb and not torch.equal(t.qweight, w.qweight) and torch.equal(t.row_words(), w.qweight)
    x = torch.randn(k, generator=g).to(dtype)
    gu = torch.randn(2 * k, generator=g).to(dtype)
    for blocks in ((32, 128, 4, 1, 1, 1), (64, 128, 4, 2, 2, 1), (16, 64, 4, 2, 1, 1), (32, 128, 4, 2, 2, 0),
                   (64, 32, 4, 1, 1, 0)):
        for pro, inp in ((decode.PROLOGUE_PLAIN, x), (decode.PROLOGUE_SILU, gu)):
            want = torch.full((n,), float("nan"), dtype=dtype)
            got = torch.full((n,), float("nan"), dtype=dtype)
            gemv_int4.launch(pro, inp, w, None, want, blocks=blocks)
            gemv_int4.launch(pro, inp, t, None, got, blocks=blocks)
            assert torch.isfinite(want).all() and torch.equal(got, want), (blocks, pro)


def test_send_epilogue_writes_the_rows_tagged_into_the_peer_inbox():
    """The TP2 exchange from the int4 GEMV (mode "send"): 8-byte words, tag above, two bf16 values below."""
    class Xs:  # the fields engine.allreduce.epilogue's exchange hands the kernels
        def __init__(self):
            self.peer_inbox = torch.zeros(64, dtype=torch.int64)
            self.inbox = torch.zeros(64, dtype=torch.int64)
            self.serial = torch.tensor([41], dtype=torch.int64)
            self.failed = torch.zeros(1, dtype=torch.int32)
            self.ready = torch.zeros(2, dtype=torch.int64)
            self.slot_words, self.timeout_ns = 32, 10 ** 9

    class Ticket:
        def __init__(self, xs):
            self.xs, self.slot, self.e = xs, 1, 3

    g = torch.Generator().manual_seed(9)
    w = packed(64, 128, 32, g)
    x = torch.randn(128, generator=g).to(torch.bfloat16)
    xs = Xs()
    out = torch.empty(64, dtype=torch.bfloat16)
    gemv_int4.launch(decode.PROLOGUE_PLAIN, x, w, None, out, send=Ticket(xs), blocks=(16, 64, 4))
    words = xs.peer_inbox[32:64]
    tag = ((41 & 0x3FFFFF) + 1) << 8 | 3
    assert ((words >> 32) == tag).all()
    vals = torch.stack([words & 0xFFFF, (words >> 16) & 0xFFFF], 1).reshape(-1).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(vals, out)


@pytest.mark.parametrize("method,group,tiles", [("gptq", 32, False), ("awq", 128, False), ("gptq", 64, True)])
def test_fused_decode_step_on_packed_weights_is_the_plain_step(method, group, tiles, tmp_path, monkeypatch):
    """tiles: loaded as on a GPU, the words held in tiles (gemv_int4.held); the plain step's products then read
    them back in rows."""
    from engine.core import config as ecfg
    from engine.core import weights
    from engine.core.model import Model
    from tests.quant_helpers import make_quantised

    if tiles:
        monkeypatch.setattr(gemv_int4, "TILE_DEVICES", ("cuda", "cpu"))
    make_quantised("llama-3.1-8b", tmp_path, method, group, sym=False)
    model = Model(ecfg.load(tmp_path))
    weights.load_into(model, tmp_path)
    model.setup_cache(96)
    assert model.packed()
    held = {p.tile_rows for p in model.packed()}
    assert held == ({gemv_int4.TILE_ROWS} if tiles else {0}), held
    model.forward(torch.tensor([[1, 17, 300, 42, 5]]), 0)
    caches = [(lay.k_cache.clone(), lay.v_cache.clone()) for lay in model.layers]
    tok, pos = torch.tensor([9]), torch.tensor([5])
    with torch.inference_mode():
        want = model.decode_step(tok, pos, 64)
        for lay, (k, v) in zip(model.layers, caches):
            lay.k_cache.copy_(k)
            lay.v_cache.copy_(v)
        got = model.decode_step(tok, pos, 64, "fused")
    assert rel(got, want) < 1e-5 and int(got.argmax()) == int(want.argmax())


def test_fused_hybrid_decode_step_on_packed_weights_is_the_step_on_their_dequantised_weights():
    """The 27B class at toy size: every layer matrix packed (MLP, gated attention, the Gated DeltaNet in/out
    projections, as engine.bench.int4's step runs them) through the fused blocks, against the plain step on the
    same weights dequantised; the linear-attention states and K/V caches end up the same too."""
    from tests.engine_helpers import restore_state, snapshot_state
    from tests.engine_hybrid_cases import _model

    model = _model()
    g = torch.Generator().manual_seed(21)
    swaps = []
    for layer in model.layers:
        for attr in ("wqkv", "wo", "w13", "w2", "w_in", "w_out"):
            block = layer.owner(attr)  # the mixer, or its MLP for w13 / w2
            t = getattr(block, attr, None)
            if t is not None and t.shape[0] % 8 == 0:  # zero points come in words of eight outputs
                n, k = t.shape
                p = packed(n, k, 32, g)
                p.scales = (p.scales.float() * 3).half()  # weights of ~0.08, as the dense ones
                swaps.append((block, attr, p))
    assert {attr for _, attr, _ in swaps} >= {"wqkv", "wo", "w13", "w2", "w_out"}
    start = snapshot_state(model)
    tok, pos = torch.tensor([7]), torch.tensor([40])
    with torch.inference_mode():
        for layer, attr, p in swaps:
            setattr(layer, attr, p.dequantise(torch.float32))
        want = model.decode_step(tok, pos, 64)
        want_states = snapshot_state(model)
        restore_state(model, start)
        for layer, attr, p in swaps:
            setattr(layer, attr, p)
        got = model.decode_step(tok, pos, 64, "fused")
    assert rel(got, want) < 1e-4 and int(got.argmax()) == int(want.argmax())
    for a, b in zip(snapshot_state(model), want_states):
        assert torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("key", ["gptq-sym-g32", "awq-g64-all-packed"])
def test_fused_decode_step_on_a_packed_gdn_checkpoint_is_the_plain_step(key, tmp_path):
    """A Qwen3.5 checkpoint with the Gated DeltaNet projections packed (tests/engine/test_engine_gdn_packed.py): w_in as
    packed [in_proj_qkv | z] beside dense [b | a] (each part's norm-prologue GEMV), or all four as one packed matrix;
    out_proj through the plain-prologue int4 GEMV; against the plain step (the products on the dequantised weights),
    the linear-attention states after both the same."""
    from engine.core import config as ecfg
    from engine.core import weights
    from engine.core.model import Model
    from tests.engine.test_engine_gdn_packed import CASES, make_hybrid

    method, group, sym, dense, override = CASES[key]
    make_hybrid(tmp_path, method, group, sym, dense, override)
    model = Model(ecfg.load(tmp_path))
    weights.load_into(model, tmp_path)
    model.setup_cache(96)
    lin = [la for la in model.layers if la.kind == "linear_attention"]
    assert isinstance(lin[0].w_in, quant.Rows if dense else quant.PackedLinear)
    model.forward(torch.tensor([[1, 17, 300, 42, 5]]), 0)
    held = [(la, la.rec_state.clone(), la.conv_ring.clone()) for la in lin]
    caches = [(la, la.k_cache.clone(), la.v_cache.clone()) for la in model.attention_layers]
    tok, pos = torch.tensor([9]), torch.tensor([5])
    with torch.inference_mode():
        want = model.decode_step(tok, pos, 64)
        want_states = [(la.rec_state.clone(), la.conv_ring.clone()) for la in lin]
        for la, r, c in held:
            la.rec_state.copy_(r)
            la.conv_ring.copy_(c)
        for la, k, v in caches:
            la.k_cache.copy_(k)
            la.v_cache.copy_(v)
        got = model.decode_step(tok, pos, 64, "fused")
    assert rel(got, want) < 1e-5 and int(got.argmax()) == int(want.argmax())
    for la, (r, c) in zip(lin, want_states):
        assert torch.allclose(la.rec_state, r, rtol=1e-5, atol=1e-5)
        assert torch.allclose(la.conv_ring, c, rtol=1e-5, atol=1e-5)  # the projections, summed in another order
