"""The decoder: Llama / Qwen2 / Qwen3 dense, the Qwen3.5 hybrid and Qwen3-Next (the hybrid with MoE MLPs), one code path for a whole model or one
tensor-parallel rank.

The layer table (``LAYER_KINDS``) says what each kind of layer holds and how it runs; a dense model is all
``full_attention``, a hybrid one mixes in ``linear_attention`` (Gated DeltaNet) layers per the config's
layer_types. Every layer is a mixer (attention or Gated DeltaNet) and an MLP, each closed by an allreduce.

A rank holds ``1/world`` of the heads, of the MLP width and of the vocabulary;
the two points where partial results meet are the row-parallel outputs (o_proj,
down_proj: summed by ``comm.allreduce_sum``) and the vocabulary-split head
(``comm.gather_last``). With world = 1 there is no comm and no extra work.

Two forward paths share the weights:
  ``forward(tokens, pos0)``          prefill chunks: positions are Python ints.
  ``decode_step(tok, pos, window)``  THE decode step, one token with positions as device tensors and
                                     attention over a fixed cache window, so the whole step can be
                                     captured in a CUDA graph. Everything that decodes calls it (the
                                     runner, ranks, `generate`, the benches); engine/core/runner.py's Decoder
                                     replays it from graphs per context bucket.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.core import prefill_attention
from engine.core.config import ModelConfig
from engine.core.quant import matmul  # F.linear for dense or packed (GPTQ / AWQ) weights


class Comm(Protocol):
    def allreduce_sum(self, x: torch.Tensor) -> torch.Tensor: ...
    def gather_last(self, x: torch.Tensor) -> torch.Tensor: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zc: bool = False) -> torch.Tensor:
    # As Hugging Face does it: statistics in float32, result cast back before the weight multiply (Llama,
    # Qwen2/3); zero-centred (Qwen3.5, ``zc``): the weight applied as (1 + w) in float32, one rounding at the end.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if zc:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


# What each kind of layer holds, how it splits under TP2 and what runs it (DESIGN.md: the layer table).
LAYER_KINDS = {
    "full_attention": {
        "weights": "wqkv (q [with the output gate per head] | k | v), wo; q/k norms",
        "state": "K/V cache [1, kv heads, context, head dim] per layer",
        "tp2": "heads split (q, gate, k, v rows; o columns), o_proj into the exchange",
        "kernels": "attn_block (torch) or engine.core.attention's fused one-query attention",
    },
    "linear_attention": {
        "weights": "w_in (in_proj_qkv | z | b | a), depthwise conv [channels, kernel], A_log, dt_bias, gated "
                   "norm, w_out",
        "state": "conv ring [channels, kernel] in the dtype and recurrent state [value heads, dk, dv] float32, "
                 "fixed size per sequence",
        "tp2": "key and value heads split (conv channels, b/a rows, A_log, dt_bias follow); out_proj into the "
               "exchange",
        "kernels": "gdn_block (torch: engine.kernels.gdn) or engine.core.gdn_fused's decode kernel; prefill: gdn.chunked "
                   "or engine.kernels.gdn_chunk's kernel (one launch per layer and chunk)",
    },
}
# What each kind of MLP holds (config.MLP_KINDS; per layer from cfg.mlp_types): both close with the allreduce.
MLP_KINDS = {
    "dense": {"weights": "w13 (gate | up), w2", "tp2": "gate/up rows, down columns split"},
    "moe": {"weights": "router [E, D], ew13 [E, 2 fe, D], ew2 [E, D, fe], the shared expert as w13 / w2, "
                       "shared_gate [1, D] (engine.core.moe)",
            "tp2": "every expert's gate/up rows and down columns split (each rank a slice of every expert); "
                   "router and shared gate replicated",
            "kernels": "engine.core.moe: top-k on the device, the k experts gathered into two batched products "
                       "(capturable); the shared expert through the path's mlp block"},
}
STATE_KEYS = ("k_cache", "v_cache", "k_scale", "v_scale", "conv_ring", "rec_state")  # per-sequence, not weights


def inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2], with the config's scaling (default, linear, llama3, yarn)."""
    dim = cfg.rotary_dim  # the whole head, or its first part (Qwen3.5's partial rotary factor)
    freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling
    if not sc:
        return freq
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "linear":
        return freq / float(sc["factor"])
    if kind == "llama3":
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > old / lo, freq / factor, freq)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":  # YaRN (arXiv 2309.00071), as transformers computes it: a ramp between interpolation and
        # extrapolation over the dimensions whose wavelengths fall between beta_fast and beta_slow rotations
        factor = float(sc["factor"])
        base = cfg.rope_theta
        old = float(sc.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        fast, slow = float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1)

        def correction(rotations: float) -> float:
            return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction(fast), correction(slow)
        if sc.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return freq


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor YaRN applies to cos and sin (1 for every other RoPE): 0.1 ln(factor) + 1, or the config's
    attention_factor, or the mscale / mscale_all_dim ratio where both are given (transformers' rule)."""
    sc = cfg.rope_scaling
    if not sc or sc.get("rope_type", sc.get("type")) != "yarn":
        return 1.0
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    factor = float(sc["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if sc.get("mscale") and sc.get("mscale_all_dim"):
        return mscale(factor, float(sc["mscale"])) / mscale(factor, float(sc["mscale_all_dim"]))
    return mscale(factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin on the first cos.shape[-1] of the last dimension (all of it, or the
    rotary part of a partial rotary factor); the rest passes through."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    xr, xp = x[..., :rot], x[..., rot:]
    return torch.cat((xr * cos + rotate_half(xr) * sin, xp), dim=-1)


def attn_block(x, delta, cos, sin, pos, mask_bias, input_norm, wqkv, bqkv, q_norm, k_norm, k_cache, v_cache, wo,
               bo, *, n_heads: int, n_kv: int, hd: int, eps: float, window: int, linear=matmul,
               gated: bool = False, zc: bool = False, k_scale=None, v_scale=None):
    """The decode step's first half-layer. x, delta [1, 1, D] -> (x + delta, o_proj partial [1, 1, D]).

    Writes this position's K/V into the cache at ``pos`` and attends over cache positions [0, window):
    the g query heads of one kv head become g query rows against that kv head (no K/V copies), as two
    batched matrix products that spread the window over the whole GPU (a fused SDPA kernel parallelises
    over the g x kv query rows only and read the cache at ~5 % of the H200's bandwidth, bench 2026-11-29).
    ``linear``: the one-row product (F.linear, or engine.kernels.gemv.linear where Triton targets the card).
    ``gated`` (Qwen3.5): q_proj's rows are [query | gate] per head and the output is scaled by sigmoid(gate)
    before o_proj; ``zc``: zero-centred norms; cos/sin may cover only the first part of the head.
    ``k_scale``/``v_scale``: the cache is int8 with these scales (engine.core.kvquant)."""
    x = x + delta  # the previous block's reduced output
    h = rms_norm(x, input_norm, eps, zc)
    qkv = linear(h, wqkv, bqkv)  # [1, 1, (h [x 2 gated] + 2 kv) * hd]
    qn = n_heads * hd * (2 if gated else 1)
    q, k, v = qkv.split([qn, n_kv * hd, n_kv * hd], dim=-1)
    gate = None
    if gated:
        qg = q.view(1, n_heads, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(1, 1, n_heads * hd)
    q = q.reshape(1, n_heads, hd)
    k = k.view(1, n_kv, hd)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps, zc)
        k = rms_norm(k, k_norm, eps, zc)
    q = rope(q, cos, sin)  # [1, h, hd]
    k = rope(k, cos, sin)  # [1, kv, hd]
    if k_scale is None:
        k_cache.index_copy_(2, pos, k.view(1, n_kv, 1, hd))
        v_cache.index_copy_(2, pos, v.view(1, n_kv, 1, hd))
        keys, values = k_cache[:, :, :window], v_cache[:, :, :window]  # [1, kv, W, hd]
    else:
        from engine.core import kvquant

        kvquant.write(k_cache, k_scale, k.view(1, n_kv, 1, hd), pos=pos)
        kvquant.write(v_cache, v_scale, v.reshape(1, n_kv, 1, hd), pos=pos)
        keys = kvquant.dequantize(k_cache[:, :, :window], k_scale[:, :, :window], q.dtype)
        values = kvquant.dequantize(v_cache[:, :, :window], v_scale[:, :, :window], q.dtype)
    qg = q.view(1, n_kv, n_heads // n_kv, hd)  # [1, kv, g, hd]
    s = torch.matmul(qg, keys.transpose(-1, -2)).float() * (1.0 / math.sqrt(hd)) + mask_bias  # [1, kv, g, W]
    p = torch.softmax(s, dim=-1).to(values.dtype)
    a = torch.matmul(p, values).reshape(1, 1, n_heads * hd)  # [1, 1, h * hd]
    if gate is not None:
        a = a * torch.sigmoid(gate)
    return x, linear(a, wo, bo)


def gdn_block(x, delta, pos, input_norm, w_in, conv_w, a_log, dt_bias, gnorm, conv_ring, rec_state, w_out, *,
              nk: int, nv: int, dk: int, dv: int, eps: float, zc: bool = True, linear=matmul):
    """The decode step's first half-layer of a Gated DeltaNet layer. x, delta [1, 1, D] -> (x + delta,
    out_proj partial [1, 1, D]). One token: the conv ring and the recurrent state are updated in place at
    ``pos`` (gdn_mix); nothing depends on pos's value on the host (capturable)."""
    x = x + delta
    h = rms_norm(x, input_norm, eps, zc)
    proj = linear(h, w_in, None).view(-1)  # [conv channels | z | b | a]
    y = gdn_mix(proj, conv_ring, conv_w, a_log, dt_bias, gnorm, rec_state, pos, nk=nk, nv=nv, dk=dk, dv=dv, eps=eps)
    return x, linear(y.reshape(1, 1, nv * dv), w_out, None)


def gdn_mix(proj, conv_ring, conv_w, a_log, dt_bias, gnorm, rec_state, pos, *, nk: int, nv: int, dk: int, dv: int,
            eps: float) -> torch.Tensor:
    """One token's work between a Gated DeltaNet layer's projections (the signature of
    engine.core.gdn_fused.gdn_decode, in torch): proj [conv channels | z | b | a] -> y [nv dv] in proj's dtype;
    the conv ring and the recurrent state are updated in place at ``pos`` (device [1])."""
    from engine.kernels import gdn

    kd, vd = nk * dk, nv * dv
    mixed, z, b, a = proj.split([2 * kd + vd, vd, nv, nv])
    mixed = gdn.conv_step(mixed, conv_ring, conv_w, pos)
    q, k, v = mixed.split([kd, kd, vd])
    beta = torch.sigmoid(b)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    o = gdn.step(q.view(nk, dk), k.view(nk, dk), v.view(nv, dv), g, beta, rec_state)  # [nv, dv] float32
    return gated_norm(o.to(proj.dtype), z.view(nv, dv), gnorm, eps).reshape(vd)


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's gated RMSNorm over each value head: RMSNorm(o) * weight * SiLU(z), Hugging Face's rounding
    (statistics in float32, the normalised row rounded before the weight, the gate in float32)."""
    h = o.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(o.dtype)
    return (h * F.silu(z.float())).to(o.dtype)


def moe_block(x, delta, post_norm, w13, w2, router, shared_gate, ew13, ew2, *, k: int, norm_topk: bool, eps: float,
              zc: bool = False, mlp=None):
    """The decode step's second half-layer of a Qwen3-Next MoE layer. x, delta [1, 1, D] -> (x + delta, partial
    [1, 1, D]): the shared expert through ``mlp`` (mlp_block's signature: the path's own, fused or not) scaled
    by its sigmoid gate, plus the k routed experts (engine.core.moe.decode)."""
    from engine.core import moe

    x, shared = (mlp or mlp_block)(x, delta, post_norm, w13, None, w2, None, eps=eps, zc=zc)
    h = rms_norm(x, post_norm, eps, zc)
    routed = moe.decode(h, router, shared_gate, ew13, ew2, k=k, norm_topk=norm_topk)
    return x, routed + moe.gate_scale(h, shared_gate) * shared


def mlp_block(x, delta, post_norm, w13, b13, w2, b2, *, eps: float, linear=matmul, zc: bool = False):
    """The decode step's second half-layer. x, delta [1, 1, D] -> (x + delta, down_proj partial [1, 1, D])."""
    x = x + delta  # the attention's reduced output
    h = rms_norm(x, post_norm, eps, zc)
    gate, up = linear(h, w13, b13).chunk(2, dim=-1)  # [1, 1, ff] each
    return x, linear(F.silu(gate) * up, w2, b2)


class Layer:
    """One decoder layer's weights for this rank (LAYER_KINDS[kind]); q/k/v and gate/up, and a linear-attention
    layer's four input projections, are fused into single matrices."""

    def __init__(self, cfg: ModelConfig, world: int, dtype: torch.dtype, device: torch.device, kind: str,
                 mlp: str = "dense"):
        e = dict(dtype=dtype, device=device)
        # a GPTQ / AWQ checkpoint: wqkv, wo, w13, w2 (w_in, w_out) are placed by the loader (engine.core.quant_load),
        # packed or dense per module, so nothing is allocated for them here
        m = dict(dtype=dtype, device="meta") if cfg.quantization is not None else e
        self.kind = kind
        self.mlp = mlp
        self.zc = cfg.zero_centred_norm
        # a MoE layer's w13 / w2 are its shared expert (engine.core.moe)
        self.ff = (cfg.shared_expert_intermediate_size if mlp == "moe" else cfg.intermediate_size) // world
        d = cfg.hidden_size
        self.input_norm = torch.empty(d, **e)
        self.post_norm = torch.empty(d, **e)
        self.w13 = torch.empty(2 * self.ff, d, **m)  # rows: [gate | up] of this rank
        self.b13 = torch.empty(2 * self.ff, **e) if cfg.mlp_bias else None
        self.w2 = torch.empty(d, self.ff, **m)
        self.b2 = torch.empty(d, **e) if cfg.mlp_bias else None
        if mlp == "moe":
            fe = cfg.moe_intermediate_size // world
            self.router = torch.empty(cfg.num_experts, d, **e)  # replicated
            self.shared_gate = torch.empty(1, d, **e)  # replicated
            self.ew13 = torch.empty(cfg.num_experts, 2 * fe, d, **e)  # per expert: [gate | up] rows of this rank
            self.ew2 = torch.empty(cfg.num_experts, d, fe, **e)  # per expert: down_proj columns of this rank
            self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        if kind == "linear_attention":
            self._init_linear(cfg, world, e, m)
        else:
            self._init_attention(cfg, world, e, m)

    def _init_attention(self, cfg: ModelConfig, world: int, e: dict, m: dict) -> None:
        d = cfg.hidden_size
        self.n_heads = cfg.num_heads // world
        self.n_kv = cfg.num_kv_heads // world
        self.hd = cfg.head_dim
        self.gated = cfg.attn_output_gate
        self.q_rows = self.n_heads * self.hd * (2 if self.gated else 1)
        qkv = self.q_rows + 2 * self.n_kv * self.hd
        self.wqkv = torch.empty(qkv, d, **m)  # rows: [q heads (each [query | gate] if gated) | k heads | v heads]
        self.bqkv = torch.empty(qkv, **e) if cfg.attention_bias else None
        self.wo = torch.empty(d, self.n_heads * self.hd, **m)  # columns: this rank's heads
        # o_proj's bias is added once, by rank 0 only, so the allreduce sum carries it exactly once.
        self.bo = torch.empty(d, **e) if cfg.o_bias else None
        self.q_norm = torch.empty(self.hd, **e) if cfg.qk_norm else None
        self.k_norm = torch.empty(self.hd, **e) if cfg.qk_norm else None
        self.k_cache: torch.Tensor | None = None  # [1, n_kv, max_ctx, hd] (int8 with --kv-cache-dtype int8)
        self.v_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None  # [1, n_kv, max_ctx] float32 (int8 cache only)
        self.v_scale: torch.Tensor | None = None

    def _init_linear(self, cfg: ModelConfig, world: int, e: dict, m: dict) -> None:
        d = cfg.hidden_size
        self.nk = cfg.linear_num_key_heads // world
        self.nv = cfg.linear_num_value_heads // world
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv_channels = 2 * self.nk * self.dk + self.nv * self.dv  # [q | k | v] of this rank's heads
        self.kernel = cfg.linear_conv_kernel_dim
        self.w_in = torch.empty(self.conv_channels + self.nv * self.dv + 2 * self.nv, d, **m)  # [qkv | z | b | a]
        self.conv_w = torch.empty(self.conv_channels, self.kernel, **e)
        self.a_log = torch.empty(self.nv, **e)
        self.dt_bias = torch.empty(self.nv, **e)
        self.gnorm = torch.empty(self.dv, **e)
        self.w_out = torch.empty(d, self.nv * self.dv, **m)  # columns: this rank's value heads
        self.conv_ring: torch.Tensor | None = None  # [channels, kernel], slot p % kernel = input of position p
        self.rec_state: torch.Tensor | None = None  # [nv, dk, dv] float32

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor) or v is None}

    def weights(self) -> dict[str, torch.Tensor]:
        """The weight tensors (no per-sequence state)."""
        return {k: t for k, t in self.tensors().items() if t is not None and k not in STATE_KEYS}

    def attn_tensors(self, rank: int) -> tuple:
        """attn_block's weights; o_proj's bias only on rank 0 (the allreduce carries it once)."""
        return (self.input_norm, self.wqkv, self.bqkv, self.q_norm, self.k_norm, self.k_cache, self.v_cache,
                self.wo, self.bo if rank == 0 else None)

    def gdn_tensors(self) -> tuple:
        return (self.input_norm, self.w_in, self.conv_w, self.a_log, self.dt_bias, self.gnorm, self.conv_ring,
                self.rec_state, self.w_out)

    def mlp_tensors(self, rank: int) -> tuple:
        return self.post_norm, self.w13, self.b13, self.w2, self.b2 if rank == 0 else None

    def moe_tensors(self) -> tuple:
        """moe_block's weights (a "moe" MLP: no biases)."""
        return self.post_norm, self.w13, self.w2, self.router, self.shared_gate, self.ew13, self.ew2

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, norm=rms_norm):
        """Prefill: (q [B, h, T, hd], k [B, kv, T, hd], v [B, kv, T, hd], gate [B, T, h hd] or None). ``norm``:
        the q / k norm (rms_norm's signature; the speculative verification passes its one-kernel form)."""
        b, t, _ = x.shape
        qkv = matmul(x, self.wqkv, self.bqkv)  # [B, T, q rows + 2 kv hd]
        q, k, v = qkv.split([self.q_rows, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        gate = None
        if self.gated:
            qg = q.view(b, t, self.n_heads, 2 * self.hd)
            q, gate = qg[..., :self.hd], qg[..., self.hd:].reshape(b, t, self.n_heads * self.hd)
        q = q.reshape(b, t, self.n_heads, self.hd)
        k = k.view(b, t, self.n_kv, self.hd)
        v = v.view(b, t, self.n_kv, self.hd).transpose(1, 2)  # [B, kv, T, hd]
        if self.q_norm is not None:
            q = norm(q, self.q_norm, eps, self.zc)
            k = norm(k, self.k_norm, eps, self.zc)
        q = q.transpose(1, 2)  # [B, h, T, hd]
        k = k.transpose(1, 2)  # [B, kv, T, hd]
        cos, sin = cos[None, None], sin[None, None]  # [1, 1, T, rot]
        return rope(q, cos, sin), rope(k, cos, sin), v, gate


class Model:
    def __init__(self, cfg: ModelConfig, *, world: int = 1, rank: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", comm: Comm | None = None, kv_dtype: str = "auto"):
        from engine.core.kvquant import KV_DTYPES

        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv cache dtype {kv_dtype!r} is not supported; choose one of {', '.join(KV_DTYPES)}")
        self.cfg, self.world, self.rank, self.dtype = cfg, world, rank, dtype
        self.kv_int8 = kv_dtype == "int8"
        self.device = torch.device(device)
        self.comm = comm
        self.zc = cfg.zero_centred_norm
        e = dict(dtype=dtype, device=self.device)
        self.embed = torch.empty(cfg.vocab_size, cfg.hidden_size, **e)  # replicated
        self.head = torch.empty(cfg.vocab_size // world, cfg.hidden_size, **e)  # this rank's vocabulary rows
        self.norm = torch.empty(cfg.hidden_size, **e)
        self.layers = [Layer(cfg, world, dtype, self.device, kind, mlp)
                       for kind, mlp in zip(cfg.layer_types, cfg.mlp_types)]
        self.mtp = None  # engine.core.mtp.MTP: the checkpoint's draft layer(s), when the config declares them
        self.weights_origin = "checkpoint"  # or "random": generated at load (engine.core.random_weights)
        if cfg.mtp_layers:
            from engine.core.mtp import MTP

            self.mtp = MTP(cfg, world, dtype, self.device)
        self.max_context = 0
        self.decoder = None  # engine.core.runner.Decoder, set by runner.prepare(): how decode_step is run
        # the prefill's kernel choice (engine.core.runner.kernel_choice): "fused" runs the Gated DeltaNet layers'
        # chunked rule as engine.kernels.gdn_chunk's kernel; None = runner.device_kernels' at the first prefill
        self.kernels: str | None = None
        self._inv_freq = inv_freq(cfg).to(self.device)
        # a prompt's embeddings (tokens [1, T], pos0) -> [1, T, D] while a prompt with images is prefilled
        # (engine.vision.prompt.Vision.embed: the image tokens' rows are the vision tower's); None = the table's rows
        self.embed_prompt = None

    @property
    def attention_layers(self) -> list[Layer]:
        return [la for la in self.layers if la.kind == "full_attention"]

    # ---- cache and per-sequence state ------------------------------------------------------------
    def setup_cache(self, max_context: int) -> None:
        """Allocate the per-sequence state for positions [0, max_context): the full-attention layers' K/V
        cache, the linear-attention layers' conv ring and recurrent state (fixed size), the RoPE tables."""
        self.max_context = max_context
        for layer in self.layers + (self.mtp.layers if self.mtp is not None else []):
            if layer.kind == "full_attention":
                shape = (1, layer.n_kv, max_context, layer.hd)
                dt = torch.int8 if self.kv_int8 else self.dtype
                layer.k_cache = torch.zeros(shape, dtype=dt, device=self.device)
                layer.v_cache = torch.zeros(shape, dtype=dt, device=self.device)
                if self.kv_int8:
                    layer.k_scale = torch.zeros(shape[:3], dtype=torch.float32, device=self.device)
                    layer.v_scale = torch.zeros(shape[:3], dtype=torch.float32, device=self.device)
            else:
                layer.conv_ring = torch.zeros(layer.conv_channels, layer.kernel, dtype=self.dtype, device=self.device)
                layer.rec_state = torch.zeros(layer.nv, layer.dk, layer.dv, dtype=torch.float32, device=self.device)
        pos = torch.arange(max_context, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * self._inv_freq[None, :]  # [S, rot / 2], float32 as Hugging Face does
        emb = torch.cat((freqs, freqs), dim=-1)  # [S, rot]
        af = rope_attention_factor(self.cfg)  # YaRN scales cos and sin (float32, then rounded, as transformers)
        self.cos = (emb.cos() * af).to(self.dtype)
        self.sin = (emb.sin() * af).to(self.dtype)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of per-sequence state this rank holds: K/V (for the allocated context) and linear attention."""
        kv = sum(t.numel() * t.element_size() for la in self.attention_layers
                 for t in (la.k_cache, la.v_cache, la.k_scale, la.v_scale) if t is not None)
        lin = sum(t.numel() * t.element_size() for la in self.layers if la.kind == "linear_attention"
                  for t in (la.conv_ring, la.rec_state) if t is not None)
        return {"kv_cache": kv, "linear_state": lin}

    # ---- the two meeting points of tensor parallelism --------------------------------------------
    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.comm is None else self.comm.allreduce_sum(x)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.comm is None else self.comm.gather_last(x)

    def _bias_once(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        return bias if self.rank == 0 else None

    def _mlp(self, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        if layer.mlp == "moe":
            from engine.core import moe

            return moe.prefill(h, layer.router, layer.shared_gate, layer.ew13, layer.ew2, layer.w13, layer.w2,
                               k=layer.top_k, norm_topk=layer.norm_topk,
                               shared=lambda x, w13, w2: self._dense_mlp(x, w13, None, w2, None))
        return self._dense_mlp(h, layer.w13, layer.b13, layer.w2, layer.b2)

    def _dense_mlp(self, h, w13, b13, w2, b2) -> torch.Tensor:
        gu = matmul(h, w13, b13)  # [B, T, 2 ff]
        gate, up = gu.chunk(2, dim=-1)
        return matmul(F.silu(gate) * up, w2, self._bias_once(b2))

    def _attention(self, layer: Layer, h: torch.Tensor, cos, sin, pos0: int) -> torch.Tensor:
        """Prefill of a full-attention layer: h [1, T, D] -> o_proj partial [1, T, D]; K/V written."""
        t = h.shape[1]
        end = pos0 + t
        q, k, v, gate = layer.qkv(h, cos, sin, self.cfg.rms_norm_eps)
        if layer.k_scale is None:
            layer.k_cache[:, :, pos0:end] = k
            layer.v_cache[:, :, pos0:end] = v
            keys, values = layer.k_cache[:, :, :end], layer.v_cache[:, :, :end]  # [1, kv, end, hd]
        else:  # int8: the chunk attends to its own K/V as the cache holds them, as every later step will
            from engine.core import kvquant

            kvquant.write(layer.k_cache, layer.k_scale, k, pos0)
            kvquant.write(layer.v_cache, layer.v_scale, v, pos0)
            keys = kvquant.dequantize(layer.k_cache[:, :, :end], layer.k_scale[:, :, :end], q.dtype)
            values = kvquant.dequantize(layer.v_cache[:, :, :end], layer.v_scale[:, :, :end], q.dtype)
        # query head i reads kv head i // g; causal to the lower right, no [T, end] mask on a GPU
        a = prefill_attention.attend(q, keys, values, pos0)  # [1, h, T, hd]
        a = a.transpose(1, 2).reshape(1, t, layer.n_heads * layer.hd)
        if gate is not None:
            a = a * torch.sigmoid(gate)
        return matmul(a, layer.wo, self._bias_once(layer.bo))

    def _linear_attention(self, layer: Layer, h: torch.Tensor, pos0: int, states: list | None = None) -> torch.Tensor:
        """Prefill of a Gated DeltaNet layer: h [1, T, D] -> out_proj partial [1, T, D]. The chunk continues
        the layer's conv ring and recurrent state (both reset at position 0: a new sequence). ``states`` (the
        verification of speculative decoding): the tokens go through the decode step's recurrence one by one
        and (conv rings [T, C, K], recurrent states [T, nv, dk, dv]) after each position are appended to it."""
        from engine.kernels import gdn

        t = h.shape[1]
        kd, vd = layer.nk * layer.dk, layer.nv * layer.dv
        proj = matmul(h[0], layer.w_in)  # [T, conv channels + vd + 2 nv]
        mixed, z, b, a = proj.split([2 * kd + vd, vd, layer.nv, layer.nv], dim=-1)
        rings = None
        if states is not None:  # ring after position pos0 + i: the ring before with slots pos0..pos0 + i written
            rings = layer.conv_ring.clone().expand(t, -1, -1).clone()  # [T, C, K]
            for i in range(t):
                rings[i:, :, (pos0 + i) % layer.kernel] = mixed[i].to(rings.dtype)
        mixed = gdn.conv_prefill(mixed, layer.conv_ring, layer.conv_w, pos0)
        q, k, v = mixed.split([kd, kd, vd], dim=-1)
        beta = torch.sigmoid(b)
        g = -layer.a_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
        if pos0 == 0:
            layer.rec_state.zero_()
        if states is not None:
            outs, recs = [], []
            for i in range(t):
                outs.append(gdn.step(q[i].view(layer.nk, layer.dk), k[i].view(layer.nk, layer.dk),
                                     v[i].view(layer.nv, layer.dv), g[i], beta[i], layer.rec_state))
                recs.append(layer.rec_state.clone())
            o = torch.stack(outs)  # [T, nv, dv] float32
            states.append((rings, torch.stack(recs)))
        else:
            chunked = gdn.chunked
            if self._gdn_kernel(layer):
                from engine.kernels import gdn_chunk

                chunked = gdn_chunk.chunked
            o, final = chunked(q.view(t, layer.nk, layer.dk), k.view(t, layer.nk, layer.dk),
                               v.view(t, layer.nv, layer.dv), g, beta, layer.rec_state)
            layer.rec_state.copy_(final)
        y = gated_norm(o.to(h.dtype), z.view(t, layer.nv, layer.dv), layer.gnorm, self.cfg.rms_norm_eps)
        return matmul(y.reshape(1, t, vd), layer.w_out)

    def _gdn_kernel(self, layer: Layer) -> bool:
        """Whether a linear-attention prefill runs engine.kernels.gdn_chunk's kernel: kernel choice "fused" (as
        the decode step takes engine.core.gdn_fused), where the kernels run and the head sizes fit; float32 (the
        reference dtype) keeps the torch form."""
        from engine.core import attention
        from engine.kernels import gdn_chunk

        if self.kernels is None:
            from engine.core.runner import device_kernels

            self.kernels = device_kernels(self.device)[0]
        return (self.kernels == "fused" and self.dtype != torch.float32 and attention.runs_here(self.device)
                and gdn_chunk.supported(layer.dk, layer.dv))

    # ---- prefill chunks and eager decode ----------------------------------------------------------
    def chunk_inputs(self, t: int, pos0: int):
        """(cos [T, rot], sin [T, rot]) of a chunk at positions pos0..pos0+T-1 (the causal rule with the cached
        prefix is engine.core.prefill_attention's: no mask is made)."""
        if pos0 + t > self.max_context:
            raise ValueError(f"positions up to {pos0 + t} exceed the allocated context {self.max_context}")
        return self.cos[pos0:pos0 + t], self.sin[pos0:pos0 + t]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, pos0: int, all_logits: bool = False, hidden: bool = False,
                states: list | None = None):
        """tokens [1, T] at positions pos0..pos0+T-1 -> float32 logits [V] of the last position
        (or [T, V] with ``all_logits``). Writes the chunk's K/V (and linear-attention states) into the cache.
        ``hidden``: (logits, the final norm's output [T, D]: what an MTP draft layer reads); ``states``: a list
        that gets every linear-attention layer's states after each position (``_linear_attention``)."""
        cfg = self.cfg
        t = tokens.shape[1]
        cos, sin = self.chunk_inputs(t, pos0)
        x = F.embedding(tokens, self.embed) if self.embed_prompt is None else self.embed_prompt(tokens, pos0)
        x = self.layers_forward(x, lambda layer, h: (
            self._attention(layer, h, cos, sin, pos0) if layer.kind == "full_attention"
            else self._linear_attention(layer, h, pos0, states)))  # [1, T, D]
        x = rms_norm(x if all_logits or hidden else x[:, -1:], self.norm, cfg.rms_norm_eps, self.zc)
        logits = self._gather(F.linear(x if all_logits else x[:, -1:], self.head)).float()  # [1, T or 1, V]
        out = logits[0] if all_logits else logits[0, -1]
        return (out, x[0]) if hidden else out

    def layers_forward(self, x: torch.Tensor, mix) -> torch.Tensor:
        """x [1, T, D] through every layer: norm, ``mix(layer, h)`` (the mixer's partial output), allreduce, norm,
        MLP, allreduce; the final norm is the caller's (forward's; the speculative verification's)."""
        eps, zc = self.cfg.rms_norm_eps, self.zc
        for layer in self.layers:
            x = x + self._reduce(mix(layer, rms_norm(x, layer.input_norm, eps, zc)))
            x = x + self._reduce(self._mlp(layer, rms_norm(x, layer.post_norm, eps, zc)))
        return x

    # ---- THE decode step: one token with device-side positions (CUDA-graph capturable) -------------
    def decode_step(self, tok: torch.Tensor, pos: torch.Tensor, window: int, blocks: tuple | None = None,
                    exchange: str | None = None) -> torch.Tensor:
        """tok [1] and pos [1] (device int64) -> float32 logits [V]. The one decode step: the runner, the
        ranks, `generate` and the benches all call this (eagerly, or replayed from a CUDA graph by
        engine/core/runner.py's Decoder). Attention reads cache positions [0, window): no shape depends on pos,
        so one graph per window serves every position below it.

        Per layer: the mixer (attn_block: residual add, norm, QKV, RoPE, cache write, attention, o_proj of this
        rank's heads; or gdn_block: residual add, norm, the four input projections, conv, the delta rule's one
        step, gated norm, out_proj of this rank's value heads) -> allreduce -> mlp_block (residual add, norm,
        gate/up, down of this rank's columns) -> allreduce. Each block starts with the residual add of the
        previous block's reduced output, so the add fuses with the norm when the blocks are compiled.
        ``blocks``: (attn_block, mlp_block[, gdn_block]) to use, e.g. torch.compile'd or fused ones
        (engine.core.runner.kernels); None = the plain functions below. ``exchange``: where the two ranks' partial
        outputs meet (engine.core.decode_mode.EXCHANGES: the runner's DecodeMode.exchange); None or "kernel" = the
        path's allreduce. Call it under torch.inference_mode()."""
        attn, mlp = (blocks or (attn_block, mlp_block))[:2]
        gdn = blocks[2] if blocks and len(blocks) > 2 else gdn_block
        cfg = self.cfg
        zc = {"zc": True} if self.zc else {}  # dense models call the blocks exactly as before
        x = F.embedding(tok.view(1, 1), self.embed)  # [1, 1, D]
        cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)  # [1, rot]
        # additive mask, float32: 0 up to pos, -inf past it; made once per step for every layer
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        mask_bias = torch.where(torch.arange(window, device=self.device) <= pos, zero, float("-inf"))
        mask_bias = mask_bias.view(1, 1, 1, window)  # [1, 1, 1, W]
        delta = torch.zeros_like(x)
        xs = self.epilogue_exchange(blocks, exchange)  # "send": a small kernel receives what the GEMVs sent
        for i, layer in enumerate(self.layers):
            kw = {} if xs is None else {"send": xs.ticket(2 * i, cfg.hidden_size, self.dtype)}
            if layer.kind == "full_attention":
                if layer.gated:
                    kw["gated"] = True
                if layer.k_scale is not None:
                    kw.update(k_scale=layer.k_scale, v_scale=layer.v_scale)
                x, part = attn(x, delta, cos, sin, pos, mask_bias, *layer.attn_tensors(self.rank),
                               n_heads=layer.n_heads, n_kv=layer.n_kv, hd=layer.hd, eps=cfg.rms_norm_eps,
                               window=window, **zc, **kw)
            else:
                x, part = gdn(x, delta, pos, *layer.gdn_tensors(), nk=layer.nk, nv=layer.nv, dk=layer.dk,
                              dv=layer.dv, eps=cfg.rms_norm_eps, **zc, **kw)
            delta = xs.receive(part) if xs is not None else self._reduce(part)
            kw = {} if xs is None else {"send": xs.ticket(2 * i + 1, cfg.hidden_size, self.dtype)}
            if layer.mlp == "moe":  # the routed experts in torch, the shared expert through the path's mlp block
                x, part = moe_block(x, delta, *layer.moe_tensors(), k=layer.top_k, norm_topk=layer.norm_topk,
                                    eps=cfg.rms_norm_eps, **zc, mlp=mlp)
            else:
                x, part = mlp(x, delta, *layer.mlp_tensors(self.rank), eps=cfg.rms_norm_eps, **zc, **kw)
            last = i + 1 == len(self.layers)  # the last exchange is summed by xs.finish (it bumps the serial)
            delta = self._reduce(part) if xs is None else part if last else xs.receive(part)
        if xs is not None:  # the final norm in the last exchange's kernel (rows of up to 8192: epilogue_exchange)
            x = xs.finish(delta, x, self.norm, cfg.rms_norm_eps, **zc)
        else:
            x = rms_norm(x + delta, self.norm, cfg.rms_norm_eps, self.zc)
        return self._gather(F.linear(x, self.head)).float()[0, -1]  # [V]

    def offers_exchange(self, blocks: tuple | None) -> bool:
        """Whether the TP2 exchange can run inside these blocks' GEMVs (engine.allreduce.epilogue): blocks that take
        tickets (every kind of layer this model has), a path that offers the exchange, kernels that run here
        (engine.core.attention.sends_here) and rows of up to 8192 values."""
        if self.comm is None or not blocks or not getattr(blocks[0], "sends", False) or self.cfg.moe:
            return False  # (moe_block takes no ticket: a MoE model exchanges through the path's allreduce)
        if self.cfg.hybrid and not (len(blocks) > 2 and getattr(blocks[2], "sends", False)):
            return False
        if getattr(getattr(self.comm, "path", None), "epilogue", None) is None:
            return False
        from engine.core import attention

        return attention.sends_here(self) and self.cfg.hidden_size <= 8192

    def epilogue_exchange(self, blocks: tuple | None, exchange: str | None):
        """The path's exchange (engine.allreduce.epilogue.EpilogueExchange) when ``exchange`` (a DecodeMode's) sends
        from the GEMVs and these blocks take it (offers_exchange); else None: the path's allreduce."""
        if exchange in (None, "kernel") or not self.offers_exchange(blocks):
            return None
        return self.comm.path.epilogue()

    def weight_bytes(self) -> int:
        """Bytes this rank reads per decode step from weights (embedding: one row, not the table)."""
        n = self.head.numel() + self.norm.numel() + self.cfg.hidden_size
        for layer in self.layers:
            n += sum(t.numel() for t in layer.weights().values())
            if layer.mlp == "moe":  # a step reads the k chosen experts of E
                n -= (layer.ew13.numel() + layer.ew2.numel()) * (layer.router.shape[0] - layer.top_k) // layer.router.shape[0]
        return n * self.head.element_size() + sum(p.nbytes for p in self.packed())

    def packed(self) -> list:
        """The packed (GPTQ / AWQ) matrices of this rank (engine.core.quant.PackedLinear, or a Rows: packed parts
        stacked with dense ones, counted whole)."""
        from engine.core.quant import is_packed

        return [w for layer in self._all_layers() for w in vars(layer).values() if is_packed(w)]

    def _all_layers(self) -> list:
        """The decoder's layers and the MTP draft layers (their weights are held too)."""
        return self.layers + (self.mtp.layers if self.mtp is not None else [])

    def weights_info(self) -> dict:
        """What `generate --json` and the rank's ready message report: the weight format and the bytes this rank
        holds for weights (every tensor but the per-sequence state; packed matrices as their packed tensors)."""
        q = self.cfg.quantization
        dense = [self.embed, self.head, self.norm] + [t for layer in self._all_layers() for t in layer.weights().values()]
        if self.mtp is not None:
            dense += [self.mtp.fc, self.mtp.emb_norm, self.mtp.hid_norm, self.mtp.norm]
        held = sum(t.numel() * t.element_size() for t in dense) + sum(p.nbytes for p in self.packed())
        fmt = str(self.dtype).removeprefix("torch.") if q is None else f"{q.format} ({str(self.dtype)[6:]} dense)"
        info = {"format": fmt, "bytes": held, "packed_matrices": len(self.packed())}
        if self.weights_origin != "checkpoint":
            info["origin"] = self.weights_origin  # random weights: the shape's speed and memory, not answers
        return info
