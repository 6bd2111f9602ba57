"""Cases run by tests/engine/test_engine_fused_kernels.py in a child pytest under Triton's interpreter
(TRITON_INTERPRET=1 must be set before triton is first imported, and torch.compile imports it: hence a
process of its own; the file name keeps the main run from collecting it).

The fused decode kernels (kernel choice "fused", engine/kernels/decode.py: the one-query attention and the prologue
GEMVs) against the plain torch blocks on CPU tensors: the norm / SiLU prologues, the one-kernel
attention (q/k norm, RoPE, cache write, split-window softmax, both ways of combining the splits) and whole
decode steps of small real architectures. float32 must agree to rounding; bf16 must be as close to float32
as the plain bf16 blocks are (at most 1.5x their error, floor 1e-3: the variants bench's bar). The interpreter
rounds float32 -> bf16 by truncation; the kernels round to nearest-even by hand there, as the GPU does.
On a GPU: tests/engine/test_engine_fused_gpu.py."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from engine.core.model import rms_norm, rotate_half
from engine.kernels import decode
from tests.engine_helpers import random_small_model

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/engine/test_engine_fused_kernels.py with TRITON_INTERPRET=1", allow_module_level=True)

D, H, KV, HD, S, W = 256, 4, 2, 64, 64, 48
EPS = 1e-6


@pytest.fixture(autouse=True)
def kernels_on_cpu(monkeypatch):
    monkeypatch.setattr(decode, "CPU_KERNELS", True)  # the fused blocks run their kernels on CPU tensors


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _t(*shape, dtype, g, scale=1.0, mean=0.0):
    return (mean + scale * torch.randn(*shape, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_norm_prologue_gemv_is_rmsnorm_of_the_residual_then_the_product(dtype, bias):
    """Statistics first, then the product of the normalised row (Hugging Face's rounding)."""
    g = torch.Generator().manual_seed(1)
    n = 96  # not a multiple of the rows per program
    x, d = _t(1, 1, D, dtype=dtype, g=g), _t(1, 1, D, dtype=dtype, g=g)
    nw = _t(D, dtype=dtype, g=g, scale=0.1, mean=1.0)
    w = _t(n, D, dtype=dtype, g=g, scale=0.05)
    b = _t(n, dtype=dtype, g=g, scale=0.1) if bias else None
    y, x_new = decode.linear_norm(x, d, nw, EPS, w, b)
    assert y.shape == (1, 1, n) and x_new.shape == x.shape and y.dtype == dtype
    want = F.linear(rms_norm(x + d, nw, EPS), w, b)
    ref = F.linear(rms_norm(x.float() + d.float(), nw.float(), EPS), w.float(), None if b is None else b.float())
    if dtype is torch.float32:
        assert torch.equal(x_new, x + d)
        assert rel(y, want) < 1e-6
    else:
        assert (x_new.float() - (x + d).float()).abs().max() <= (x + d).float().abs().max() * 2 ** -7
        assert rel(y, ref) <= max(1.5 * rel(want, ref), 1e-3)
    # a K that is not a multiple of the block: the masked tail
    y2, _ = decode.linear_norm(x[..., :200], d[..., :200], nw[:200], EPS, w[:, :200].contiguous(), b)
    want2 = F.linear(rms_norm((x + d)[..., :200], nw[:200], EPS), w[:, :200], b)
    assert rel(y2, want2) < (1e-6 if dtype is torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_prologue_gemv_is_the_down_product_of_silu_gate_times_up(dtype):
    g = torch.Generator().manual_seed(2)
    ff, n = 192, 80
    gu = _t(1, 1, 2 * ff, dtype=dtype, g=g, scale=2.0)
    w = _t(n, ff, dtype=dtype, g=g, scale=0.05)
    b = _t(n, dtype=dtype, g=g, scale=0.1)
    y = decode.linear_silu(gu, w, b)
    gate, up = gu.chunk(2, dim=-1)
    want = F.linear(F.silu(gate) * up, w, b)
    ref = F.linear(F.silu(gate.float()) * up.float(), w.float(), b.float())
    assert y.shape == (1, 1, n)
    if dtype is torch.float32:
        assert rel(y, want) < 1e-6
    else:
        assert rel(y, ref) <= max(1.5 * rel(want, ref), 1e-3)


def _attn_inputs(dtype, qk_norm: bool, p: int, g):
    qkv = _t(1, 1, (H + 2 * KV) * HD, dtype=dtype, g=g)
    qn = _t(HD, dtype=dtype, g=g, scale=0.1, mean=1.0) if qk_norm else None
    kn = _t(HD, dtype=dtype, g=g, scale=0.1, mean=1.0) if qk_norm else None
    kc, vc = _t(1, KV, S, HD, dtype=dtype, g=g), _t(1, KV, S, HD, dtype=dtype, g=g)
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
    emb = torch.cat([p * inv, p * inv])
    return qkv, qn, kn, kc, vc, emb.cos().to(dtype)[None], emb.sin().to(dtype)[None]


def _torch_attention(qkv, qn, kn, kc, vc, cos, sin, p):
    """The plain block's attention (engine.core.model.attn_block between its two products)."""
    q, k, v = qkv.split([H * HD, KV * HD, KV * HD], dim=-1)
    q, k = q.view(1, H, HD), k.view(1, KV, HD)
    if qn is not None:
        q, k = rms_norm(q, qn, EPS), rms_norm(k, kn, EPS)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    pos = torch.tensor([p])
    kc.index_copy_(2, pos, k.view(1, KV, 1, HD))
    vc.index_copy_(2, pos, v.view(1, KV, 1, HD))
    mask = torch.where(torch.arange(W) <= p, 0.0, float("-inf")).view(1, 1, 1, W)
    s = torch.matmul(q.view(1, KV, H // KV, HD), kc[:, :, :W].transpose(-1, -2)).float() / math.sqrt(HD) + mask
    return torch.matmul(torch.softmax(s, dim=-1).to(vc.dtype), vc[:, :, :W]).reshape(1, 1, H * HD)


@pytest.mark.parametrize("dtype,qk_norm,p,combine,splits,block_s", [
    (torch.float32, False, 0, "last", None, 16),  # three programs per kv head, two of them past pos
    (torch.float32, True, 0, "kernel", None, 32),
    (torch.float32, False, 20, "kernel", 1, 16),  # one program walks three tiles
    (torch.float32, True, 20, "last", None, 16),
    (torch.float32, True, W - 1, "last", 1, 32),
    (torch.float32, False, W - 1, "kernel", None, 16),
    (torch.float32, True, 30, "last", None, 128),  # the whole window in one tile
    (torch.bfloat16, True, 0, "last", None, 16),
    (torch.bfloat16, True, 33, "last", None, 16),
    (torch.bfloat16, False, W - 1, "kernel", 1, 16),
])
def test_one_kernel_attention_matches_the_torch_attention(dtype, qk_norm, p, combine, splits, block_s):
    """q/k norm, RoPE, the K/V write at pos and the masked one-query attention; the kernel never reads
    cache positions at or past pos (they hold NaN here: one read would poison the answer)."""
    g = torch.Generator().manual_seed(3 + p)
    qkv, qn, kn, kc, vc, cos, sin = _attn_inputs(dtype, qk_norm, p, g)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kc[:, :, p:], vc[:, :, p:] = float("nan"), float("nan")
    out = decode.decode_attention(qkv, cos, sin, torch.tensor([p]), qn, kn, kc, vc, n_heads=H, n_kv=KV, hd=HD,
                                  eps=EPS, window=W, combine=combine, splits=splits,
                                  block_s=block_s)
    want = _torch_attention(qkv, qn, kn, kc_ref, vc_ref, cos, sin, p)
    assert out.shape == (1, 1, H * HD) and out.dtype == dtype and torch.isfinite(out).all()
    # the cache: position p written (K after norm and RoPE, V as is), the rest untouched
    assert torch.isnan(kc[:, :, p + 1:]).all() and torch.equal(kc[:, :, :p], kc_ref[:, :, :p])
    assert torch.equal(vc[:, :, p], vc_ref[:, :, p])
    if dtype is torch.float32:
        assert torch.allclose(kc[:, :, p], kc_ref[:, :, p], rtol=1e-5, atol=1e-5)
        assert rel(out, want) < 1e-5
    else:
        f32 = [t.float() if t is not None else None for t in (qkv, qn, kn)]
        ref = _torch_attention(*f32, kc_ref.float(), vc_ref.float(), cos.float(), sin.float(), p)
        assert (kc[:, :, p].float() - kc_ref[:, :, p].float()).abs().max() <= 2 ** -6 * kc_ref.float().abs().max()
        assert rel(out, ref) <= max(1.5 * rel(want, ref), 1e-3)
    again = decode.decode_attention(qkv, cos, sin, torch.tensor([p]), qn, kn, kc, vc, n_heads=H, n_kv=KV, hd=HD,
                                    eps=EPS, window=W, combine=combine, splits=splits, block_s=block_s)
    assert torch.equal(out, again)  # fixed reduction order
    kc2, vc2 = kc_ref.clone(), vc_ref.clone()
    kc2[:, :, p:], vc2[:, :, p:] = float("nan"), float("nan")
    apart = decode.decode_attention(qkv, cos, sin, torch.tensor([p]), qn, kn, kc2, vc2, n_heads=H, n_kv=KV,
                                    hd=HD, eps=EPS, window=W, combine=combine, splits=splits, block_s=block_s,
                                    apart=True)
    # position p attended apart from its tile: the same cache write, the same answer to the summation order
    assert torch.equal(kc2[:, :, :p + 1].isnan(), kc[:, :, :p + 1].isnan()) and torch.equal(vc2[:, :, p], vc[:, :, p])
    assert torch.isfinite(apart).all()
    assert rel(apart, out) < (1e-6 if dtype is torch.float32 else 1e-2)


def _model(name: str, **override):
    return random_small_model(name, 96, **override)


@pytest.mark.parametrize("name,override", [
    ("llama-3.1-8b", {}),  # llama3 RoPE scaling, no biases, head dim 32
    ("qwen3-8b", {"head_dim": 64}),  # q/k norm
    ("qwen2.5-0.5b", {}),  # QKV bias
    ("qwen3-8b", {}),  # head dim 48: the attention falls back to the plain one, the GEMVs stay fused
])
def test_fused_blocks_give_the_plain_decode_step(name, override):
    model = _model(name, **override)
    caches = [(lay.k_cache.clone(), lay.v_cache.clone()) for lay in model.layers]
    tok, pos = torch.tensor([5]), torch.tensor([40])
    with torch.inference_mode():
        want = model.decode_step(tok, pos, 64)
        k_want = [lay.k_cache.clone() for lay in model.layers]
        for lay, (k, v) in zip(model.layers, caches):
            lay.k_cache.copy_(k)
            lay.v_cache.copy_(v)
        got = model.decode_step(tok, pos, 64, "fused")
    assert rel(got, want) < 1e-5 and int(got.argmax()) == int(want.argmax())
    for lay, k in zip(model.layers, k_want):
        assert torch.allclose(lay.k_cache, k, atol=1e-5)


