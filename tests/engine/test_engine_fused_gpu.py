"""The fused decode kernels on a GPU (pytest -m gpu on the device): whole bf16 decode steps with the
fused blocks as close to float32 as the plain bf16 step, captured in a CUDA graph and replayed
bit-identically. CPU checks of every kernel: tests/engine/test_engine_fused_kernels.py."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import decode
from tests.engine_helpers import small_config


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,override", [("qwen3-8b", {"head_dim": 128, "hidden_size": 512, "num_attention_heads": 8,
                                                          "num_key_value_heads": 2}), ("llama-3.1-8b", {})])
def test_on_the_gpu_fused_steps_match_the_plain_step_in_bf16_and_in_a_graph(name, override):
    """bf16 on the device: the fused step as close to float32 as the plain bf16 step (x1.5 + 1e-3, the
    variants bench's bar), captured in a CUDA graph and replayed bit-identically."""
    from engine.core import config as ecfg
    from engine.core import timing
    from engine.core.model import Model
    from engine.core.weights import expected_tensors

    raw = small_config(name)
    raw.update(override, num_hidden_layers=4)
    cfg = ecfg.from_dict(raw)
    models = {}
    for dt in (torch.float32, torch.bfloat16):
        m = Model(cfg, dtype=dt, device="cuda")
        g = torch.Generator().manual_seed(7)
        with torch.inference_mode():
            for label, t in expected_tensors(m):
                t.copy_(torch.empty(t.shape).normal_(1.0 if "norm" in label else 0.0,
                                                     0.1 if t.dim() == 1 else 0.05, generator=g))
            m.setup_cache(1280)
            for layer in m.layers:
                layer.k_cache.copy_(torch.empty(layer.k_cache.shape).normal_(generator=g))
                layer.v_cache.copy_(torch.empty(layer.v_cache.shape).normal_(generator=g))
        models[dt] = m
    tok, pos = torch.tensor([5], device="cuda"), torch.tensor([1000], device="cuda")
    with torch.inference_mode():
        ref = models[torch.float32].decode_step(tok, pos, 1024)
        m = models[torch.bfloat16]
        plain = m.decode_step(tok, pos, 1024)
        fused = m.decode_step(tok, pos, 1024, "fused")
        out = {}
        graph = timing.capture(lambda: out.__setitem__("y", m.decode_step(tok, pos, 1024, "fused")))
        graph.replay()
        torch.cuda.synchronize()
        first = out["y"].clone()
        graph.replay()
        torch.cuda.synchronize()
    assert torch.isfinite(fused).all()
    assert rel(fused, ref) <= max(1.5 * rel(plain, ref), 1e-3)
    assert torch.equal(first, fused) and torch.equal(out["y"], first)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", ["qwen3.5-27b", "qwen3-8b"])
def test_long_window_attention_takes_its_pipelined_configuration_and_stays_as_close(shape):
    """At 128K positions the one-query attention runs decode.LONG_CONFIG (three tiles in flight): its output is
    as close to the earlier configuration's as that one is to itself in another tiling, and bit-identical on
    replay."""
    from engine.bench.attention import SHAPES

    sh = SHAPES[shape]
    h, kv, hd, ctx = sh["n_heads"], sh["n_kv"], sh["hd"], 131072
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(h * hd * (2 if sh["gated"] else 1) + 2 * kv * hd, device="cuda", generator=g).bfloat16()
    cos = torch.randn(1, sh["rot"], device="cuda", generator=g).bfloat16()
    sin = torch.randn(1, sh["rot"], device="cuda", generator=g).bfloat16()
    qn, kn = ((0.1 * torch.randn(hd, device="cuda", generator=g)).bfloat16() for _ in range(2))
    k = torch.randn(1, kv, ctx, hd, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, kv, ctx, hd, device="cuda", generator=g).bfloat16()
    pos = torch.tensor([ctx - 1], device="cuda")

    def call(**kw):
        return decode.decode_attention(qkv, cos, sin, pos, qn, kn, k, v, n_heads=h, n_kv=kv, hd=hd, eps=1e-6,
                                       window=ctx, gated=sh["gated"], zc=sh["zc"], **kw).float()

    old_bs, old_w = decode.HD256_CONFIG[:2] if hd >= 256 else (decode.BLOCK_S, decode.NUM_WARPS)
    new = call()
    old = call(block_s=old_bs, num_warps=old_w, stages=1)
    other = call(block_s=old_bs // 2, num_warps=old_w, stages=1)
    bs, warps, stages = decode.LONG_CONFIG[hd]
    assert torch.equal(new, call(block_s=bs, num_warps=warps, stages=stages))  # the default is the long one
    assert torch.equal(new, call())
    assert rel(new, old) <= max(1.5 * rel(other, old), 5e-3), (rel(new, old), rel(other, old))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", ["qwen3.5-27b", "qwen3-8b"])
@pytest.mark.parametrize("at", [40, 8092])
def test_int8_cache_attention_in_both_forms_is_the_dequantised_caches_attention(shape, dtype, at):
    """An int8 cache of 8K positions, fp16 and bf16, widened by Triton and (fp16) by the byte permute: the step's
    own position inside its tile and apart from the tiles give the attention over the dequantised
    caches (the 16-bit kernel on caches holding the int8 values times their scales), and each form is
    bit-identical on a second call. At position 40 the step's own K/V weigh about 1/41 of the answer: a form that
    lost them would be off by more than the bound (the reference's own position is not quantised: about 0.4 %
    per value)."""
    from engine.bench.attention import SHAPES
    from engine.core import kvquant

    sh = SHAPES[shape]
    h, kv, hd, ctx = sh["n_heads"], sh["n_kv"], sh["hd"], 8192
    g = torch.Generator(device="cuda").manual_seed(9)
    qkv = torch.randn(h * hd * (2 if sh["gated"] else 1) + 2 * kv * hd, device="cuda", generator=g).to(dtype)
    cos = torch.randn(1, sh["rot"], device="cuda", generator=g).to(dtype)
    sin = torch.randn(1, sh["rot"], device="cuda", generator=g).to(dtype)
    qn, kn = ((0.1 * torch.randn(hd, device="cuda", generator=g) + 1.0).to(dtype) for _ in range(2))
    k = torch.randn(1, kv, ctx, hd, device="cuda", generator=g)
    v = torch.randn(1, kv, ctx, hd, device="cuda", generator=g)
    (kq, ks), (vq, vs) = kvquant.quantize(k), kvquant.quantize(v)
    pos = torch.tensor([at], device="cuda")

    def call(kc, vc, ksc=None, vsc=None, **kw):
        return decode.decode_attention(qkv, cos, sin, pos, qn, kn, kc, vc, n_heads=h, n_kv=kv, hd=hd, eps=1e-6,
                                       window=ctx, gated=sh["gated"], zc=sh["zc"], k_scale=ksc, v_scale=vsc,
                                       **kw).float()

    outs = {}
    for apart, permute in ((False, False), (True, False), (False, True), (True, True)):
        kc, vc, ksc, vsc = kq.clone(), vq.clone(), ks.clone(), vs.clone()
        key = (apart, permute)
        outs[key] = call(kc, vc, ksc, vsc, apart=apart, permute=permute)
        assert torch.isfinite(outs[key]).all()
        assert torch.equal(outs[key], call(kc, vc, ksc, vsc, apart=apart, permute=permute))
        assert torch.equal(kc[:, :, :at], kq[:, :, :at]) and not torch.equal(kc[:, :, at], kq[:, :, at])
    kd, vd = kvquant.dequantize(kq, ks, dtype), kvquant.dequantize(vq, vs, dtype)
    ref = call(kd, vd)
    for key, out in outs.items():  # the reference's caches are rounded to the dtype: 1.2 % at 8K on the 8B shape
        assert rel(out, ref) < (1e-2 if at == 40 else 2e-2), (key, rel(out, ref))
    assert rel(outs[True, False], outs[False, False]) < 5e-3
    # the byte permute widens exactly (bf16 ignores it): the same answers as Triton's conversion
    assert torch.equal(outs[False, True], outs[False, False]) and torch.equal(outs[True, True], outs[True, False])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(5120, 17408), (4096, 12288)])
def test_silu_down_with_each_dtypes_blocks_is_the_eager_product(dtype, n, k):
    """SiLU + down as the step runs it (decode.linear_silu: fp16 takes the table's fp16_silu, bf16 its prologue blocks)
    against the eager product in float32 on the same rounded h, and the same answer on a second call."""
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(11)
    w = (0.02 * torch.randn(n, k, device="cuda", generator=g)).to(dtype)
    gu = torch.randn(1, 1, 2 * k, device="cuda", generator=g).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    h = (F.silu(gate.float()).to(dtype).float() * up.float()).to(dtype).float()
    got = decode.linear_silu(gu, w)
    assert got.dtype == dtype and got.shape == (1, 1, n)
    ref = F.linear(h, w.float())
    assert float((got.float() - ref).norm() / ref.norm()) < 5e-3
    assert torch.equal(got, decode.linear_silu(gu, w))
