"""Decode step (batch 1, TP1) compiled ONE LAYER AT A TIME, for the benchmark's faster paths.

Why per layer: torch.compile of the whole step unrolls all layers (32 for Llama-3.1-8B) into one graph,
and its compile takes minutes. Every layer has the same shapes, so a function that takes the layer's
tensors as arguments compiles once and serves every layer (Dynamo guards on shapes, not on which tensor).
The caller captures the whole step, all layers plus the head, in one CUDA graph.

Two layer bodies:
  "plain"  the same arithmetic as Model.decode_static, layer by layer (residual adds inside the layer).
  "fused"  the residual add of the previous layer's MLP output moves into the next layer, so it fuses
           with that layer's RMSNorm into one kernel (as in the whole-step compile); the attention scale
           is applied to q before the score product, and the mask is an additive bias built once per step.
Both compute float32 logits [V] from tok [1] and pos [1] (device int64), like Model.decode_static.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.model import Model, rms_norm

LAYER_BODIES = ("plain", "fused")


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., h:], t[..., :h]), dim=-1) * sin


def _attn_in(x, cos, sin, pos, input_norm, wqkv, bqkv, q_norm, k_norm, k_cache, v_cache, *, n_heads, n_kv, hd,
             eps, q_scale):
    """Norm, q/k/v, RoPE, cache write. x [1, 1, D] -> q [1, kv, g, hd] (scaled by q_scale)."""
    h = rms_norm(x, input_norm, eps)
    qkv = F.linear(h, wqkv, bqkv)  # [1, 1, (h + 2 kv) * hd]
    q, k, v = qkv.split([n_heads * hd, n_kv * hd, n_kv * hd], dim=-1)
    q = q.view(1, n_heads, hd)
    k = k.view(1, n_kv, hd)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
        k = rms_norm(k, k_norm, eps)
    q = _rope(q, cos, sin) * q_scale  # [1, h, hd]
    k = _rope(k, cos, sin)  # [1, kv, hd]
    k_cache.index_copy_(2, pos, k.view(1, n_kv, 1, hd))
    v_cache.index_copy_(2, pos, v.view(1, n_kv, 1, hd))
    return q.view(1, n_kv, n_heads // n_kv, hd)


def _attention(qg, k_cache, v_cache, mask_bias, window: int, s_scale: float):
    """qg [1, kv, g, hd] against cache positions [0, window) -> [1, 1, h * hd]; two batched products
    (spread over the whole GPU, see Model._decode_attention), softmax statistics in float32."""
    k = k_cache[:, :, :window]  # [1, kv, W, hd]
    v = v_cache[:, :, :window]
    s = torch.matmul(qg, k.transpose(-1, -2)).float() * s_scale + mask_bias  # [1, kv, g, W]
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.matmul(p, v).reshape(1, 1, -1)  # [1, 1, h * hd]


def _mlp(x, post_norm, w13, b13, w2, b2, eps):
    h = rms_norm(x, post_norm, eps)
    gate, up = F.linear(h, w13, b13).chunk(2, dim=-1)  # [1, 1, ff] each
    return F.linear(F.silu(gate) * up, w2, b2)  # [1, 1, D]


def make_layer_fn(body: str, *, n_heads: int, n_kv: int, hd: int, eps: float, window: int):
    """The per-layer function to compile; shape constants are closed over (same for every layer)."""
    kw = dict(n_heads=n_heads, n_kv=n_kv, hd=hd, eps=eps)
    scale = 1.0 / math.sqrt(hd)

    if body == "plain":
        def layer_plain(x, cos, sin, pos, mask_bias, t):
            (input_norm, wqkv, bqkv, q_norm, k_norm, k_cache, v_cache, wo, bo, post_norm, w13, b13, w2, b2) = t
            qg = _attn_in(x, cos, sin, pos, input_norm, wqkv, bqkv, q_norm, k_norm, k_cache, v_cache,
                          q_scale=1.0, **kw)
            a = _attention(qg, k_cache, v_cache, mask_bias, window, scale)  # scaled after the product
            x = x + F.linear(a, wo, bo)
            return x + _mlp(x, post_norm, w13, b13, w2, b2, eps)
        return layer_plain

    if body == "fused":
        def layer_fused(x, delta, cos, sin, pos, mask_bias, t):
            (input_norm, wqkv, bqkv, q_norm, k_norm, k_cache, v_cache, wo, bo, post_norm, w13, b13, w2, b2) = t
            x = x + delta  # the previous layer's MLP output: fuses with this layer's norm
            qg = _attn_in(x, cos, sin, pos, input_norm, wqkv, bqkv, q_norm, k_norm, k_cache, v_cache,
                          q_scale=scale, **kw)
            a = _attention(qg, k_cache, v_cache, mask_bias, window, 1.0)
            x = x + F.linear(a, wo, bo)
            return x, _mlp(x, post_norm, w13, b13, w2, b2, eps)
        return layer_fused

    raise ValueError(f"unknown layer body {body!r} (one of {', '.join(LAYER_BODIES)})")


def _layer_tensors(layer) -> tuple:
    return (layer.input_norm, layer.wqkv, layer.bqkv, layer.q_norm, layer.k_norm, layer.k_cache, layer.v_cache,
            layer.wo, layer.bo, layer.post_norm, layer.w13, layer.b13, layer.w2, layer.b2)


def make_step(model: Model, body: str = "fused", compile_options: dict | None = None, backend: str = "inductor"):
    """step(tok [1], pos [1], window) -> float32 logits [V], with the layer function (and the head)
    compiled by torch.compile(options=compile_options); compile_options=None leaves them eager.
    One compiled function per window (the attention's shapes depend on it)."""
    if model.comm is not None or model.world != 1:
        raise ValueError("the per-layer fast step is TP1 only (no allreduce points)")
    cfg, l0 = model.cfg, model.layers[0]
    eps = cfg.rms_norm_eps
    tensors = [_layer_tensors(layer) for layer in model.layers]
    fns: dict[int, tuple] = {}

    def head(x, norm, w):
        return F.linear(rms_norm(x, norm, eps), w).float()[0, -1]  # [V]

    def build(window: int):
        fn = make_layer_fn(body, n_heads=l0.n_heads, n_kv=l0.n_kv, hd=l0.hd, eps=eps, window=window)
        hd_ = head
        if compile_options is not None:
            fn = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend,
                               options=compile_options or None)
            hd_ = torch.compile(head, fullgraph=True, dynamic=False, backend=backend,
                                options=compile_options or None)
        return fn, hd_

    def step(tok: torch.Tensor, pos: torch.Tensor, window: int) -> torch.Tensor:
        if window not in fns:
            fns[window] = build(window)
        fn, hd_ = fns[window]
        x = F.embedding(tok.view(1, 1), model.embed)  # [1, 1, D]
        cos = model.cos.index_select(0, pos)  # [1, hd]
        sin = model.sin.index_select(0, pos)
        # -inf past pos: one additive bias for every layer, made once per step
        mask_bias = torch.where(torch.arange(window, device=model.device) <= pos, 0.0, float("-inf"))
        mask_bias = mask_bias.view(1, 1, 1, window)  # [1, 1, 1, W] float32
        if body == "fused":
            delta = torch.zeros_like(x)
            for t in tensors:
                x, delta = fn(x, delta, cos, sin, pos, mask_bias, t)
            x = x + delta
        else:
            for t in tensors:
                x = fn(x, cos, sin, pos, mask_bias, t)
        return hd_(x, model.norm, model.head)

    return step
