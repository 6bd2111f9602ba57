"""The decoder: Llama / Qwen2 / Qwen3 dense, one code path for a whole model or one tensor-parallel rank.

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

from engine.core.config import ModelConfig
from engine.core.quant import matmul  # F.linear for dense or packed (GPTQ / AWQ) weights


class Comm(Protocol):
    def allreduce_sum(self, x: torch.Tensor) -> torch.Tensor: ...
    def gather_last(self, x: torch.Tensor) -> torch.Tensor: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As Hugging Face does it: statistics in float32, result cast back before the weight multiply.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2], with the config's scaling (default, linear, llama3)."""
    dim = cfg.head_dim
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
    return freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def attn_block(x, delta, cos, sin, pos, mask_bias, input_norm, wqkv, bqkv, q_norm, k_norm, k_cache, v_cache, wo,
               bo, *, n_heads: int, n_kv: int, hd: int, eps: float, window: int, linear=matmul):
    """The decode step's first half-layer. x, delta [1, 1, D] -> (x + delta, o_proj partial [1, 1, D]).

    Writes this position's K/V into the cache at ``pos`` and attends over cache positions [0, window):
    the g query heads of one kv head become g query rows against that kv head (no K/V copies), as two
    batched matrix products that spread the window over the whole GPU (a fused SDPA kernel parallelises
    over the g x kv query rows only and read the cache at ~5 % of the H200's bandwidth, bench 2026-11-29).
    ``linear``: the one-row product (F.linear, or engine.core.gemv.linear where Triton targets the card)."""
    x = x + delta  # the previous block's reduced output
    h = rms_norm(x, input_norm, eps)
    qkv = linear(h, wqkv, bqkv)  # [1, 1, (h + 2 kv) * hd]
    q, k, v = qkv.split([n_heads * hd, n_kv * hd, n_kv * hd], dim=-1)
    q = q.view(1, n_heads, hd)
    k = k.view(1, n_kv, hd)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
        k = rms_norm(k, k_norm, eps)
    q = q * cos + rotate_half(q) * sin  # [1, h, hd]
    k = k * cos + rotate_half(k) * sin  # [1, kv, hd]
    k_cache.index_copy_(2, pos, k.view(1, n_kv, 1, hd))
    v_cache.index_copy_(2, pos, v.view(1, n_kv, 1, hd))
    qg = q.view(1, n_kv, n_heads // n_kv, hd)  # [1, kv, g, hd]
    keys, values = k_cache[:, :, :window], v_cache[:, :, :window]  # [1, kv, W, hd]
    s = torch.matmul(qg, keys.transpose(-1, -2)).float() * (1.0 / math.sqrt(hd)) + mask_bias  # [1, kv, g, W]
    p = torch.softmax(s, dim=-1).to(values.dtype)
    a = torch.matmul(p, values).reshape(1, 1, n_heads * hd)  # [1, 1, h * hd]
    return x, linear(a, wo, bo)


def mlp_block(x, delta, post_norm, w13, b13, w2, b2, *, eps: float, linear=matmul):
    """The decode step's second half-layer. x, delta [1, 1, D] -> (x + delta, down_proj partial [1, 1, D])."""
    x = x + delta  # the attention's reduced output
    h = rms_norm(x, post_norm, eps)
    gate, up = linear(h, w13, b13).chunk(2, dim=-1)  # [1, 1, ff] each
    return x, linear(F.silu(gate) * up, w2, b2)


class Layer:
    """One decoder layer's weights for this rank; q/k/v and gate/up are fused into single matrices."""

    def __init__(self, cfg: ModelConfig, world: int, dtype: torch.dtype, device: torch.device):
        e = dict(dtype=dtype, device=device)
        # a GPTQ / AWQ checkpoint: the four matrices are placed by the loader (engine.core.quant_load), packed or
        # dense per module, so nothing is allocated for them here
        m = dict(dtype=dtype, device="meta") if cfg.quantization is not None else e
        self.n_heads = cfg.num_heads // world
        self.n_kv = cfg.num_kv_heads // world
        self.hd = cfg.head_dim
        self.ff = cfg.intermediate_size // world
        d = cfg.hidden_size
        qkv = (self.n_heads + 2 * self.n_kv) * self.hd
        self.input_norm = torch.empty(d, **e)
        self.post_norm = torch.empty(d, **e)
        self.wqkv = torch.empty(qkv, d, **m)  # rows: [q heads | k heads | v heads] of this rank
        self.bqkv = torch.empty(qkv, **e) if cfg.attention_bias else None
        self.wo = torch.empty(d, self.n_heads * self.hd, **m)  # columns: this rank's heads
        # o_proj's bias is added once, by rank 0 only, so the allreduce sum carries it exactly once.
        self.bo = torch.empty(d, **e) if cfg.o_bias else None
        self.q_norm = torch.empty(self.hd, **e) if cfg.qk_norm else None
        self.k_norm = torch.empty(self.hd, **e) if cfg.qk_norm else None
        self.w13 = torch.empty(2 * self.ff, d, **m)  # rows: [gate | up] of this rank
        self.b13 = torch.empty(2 * self.ff, **e) if cfg.mlp_bias else None
        self.w2 = torch.empty(d, self.ff, **m)
        self.b2 = torch.empty(d, **e) if cfg.mlp_bias else None
        self.k_cache: torch.Tensor | None = None  # [1, n_kv, max_ctx, hd]
        self.v_cache: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor) or v is None}

    def attn_tensors(self, rank: int) -> tuple:
        """attn_block's weights; o_proj's bias only on rank 0 (the allreduce carries it once)."""
        return (self.input_norm, self.wqkv, self.bqkv, self.q_norm, self.k_norm, self.k_cache, self.v_cache,
                self.wo, self.bo if rank == 0 else None)

    def mlp_tensors(self, rank: int) -> tuple:
        return self.post_norm, self.w13, self.b13, self.w2, self.b2 if rank == 0 else None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float):
        b, t, _ = x.shape
        qkv = matmul(x, self.wqkv, self.bqkv)  # [B, T, (h + 2 kv) * hd]
        q, k, v = qkv.split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        q = q.view(b, t, self.n_heads, self.hd)
        k = k.view(b, t, self.n_kv, self.hd)
        v = v.view(b, t, self.n_kv, self.hd).transpose(1, 2)  # [B, kv, T, hd]
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, eps)
            k = rms_norm(k, self.k_norm, eps)
        q = q.transpose(1, 2)  # [B, h, T, hd]
        k = k.transpose(1, 2)  # [B, kv, T, hd]
        cos, sin = cos[None, None], sin[None, None]  # [1, 1, T, hd]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v



class Model:
    def __init__(self, cfg: ModelConfig, *, world: int = 1, rank: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", comm: Comm | None = None):
        self.cfg, self.world, self.rank, self.dtype = cfg, world, rank, dtype
        self.device = torch.device(device)
        self.comm = comm
        e = dict(dtype=dtype, device=self.device)
        self.embed = torch.empty(cfg.vocab_size, cfg.hidden_size, **e)  # replicated
        self.head = torch.empty(cfg.vocab_size // world, cfg.hidden_size, **e)  # this rank's vocabulary rows
        self.norm = torch.empty(cfg.hidden_size, **e)
        self.layers = [Layer(cfg, world, dtype, self.device) for _ in range(cfg.num_layers)]
        self.max_context = 0
        self.decoder = None  # engine.core.runner.Decoder, set by runner.prepare(): how decode_step is run
        self._inv_freq = inv_freq(cfg).to(self.device)

    # ---- cache ----------------------------------------------------------------------------------
    def setup_cache(self, max_context: int) -> None:
        """Allocate the KV cache and the RoPE tables for positions [0, max_context)."""
        self.max_context = max_context
        for layer in self.layers:
            shape = (1, layer.n_kv, max_context, layer.hd)
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        pos = torch.arange(max_context, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * self._inv_freq[None, :]  # [S, hd / 2], float32 as Hugging Face does
        emb = torch.cat((freqs, freqs), dim=-1)  # [S, hd]
        self.cos = emb.cos().to(self.dtype)
        self.sin = emb.sin().to(self.dtype)

    # ---- the two meeting points of tensor parallelism --------------------------------------------
    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.comm is None else self.comm.allreduce_sum(x)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.comm is None else self.comm.gather_last(x)

    def _bias_once(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        return bias if self.rank == 0 else None

    def _mlp(self, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        gu = matmul(h, layer.w13, layer.b13)  # [B, T, 2 ff]
        gate, up = gu.chunk(2, dim=-1)
        return matmul(F.silu(gate) * up, layer.w2, self._bias_once(layer.b2))

    # ---- prefill chunks and eager decode ----------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, pos0: int, all_logits: bool = False) -> torch.Tensor:
        """tokens [1, T] at positions pos0..pos0+T-1 -> float32 logits [V] of the last position
        (or [T, V] with ``all_logits``). Writes the chunk's K/V into the cache."""
        cfg = self.cfg
        t = tokens.shape[1]
        if pos0 + t > self.max_context:
            raise ValueError(f"positions up to {pos0 + t} exceed the allocated context {self.max_context}")
        x = F.embedding(tokens, self.embed)  # [1, T, D]
        cos, sin = self.cos[pos0:pos0 + t], self.sin[pos0:pos0 + t]  # [T, hd]
        end = pos0 + t
        # Causal mask with the cached prefix: query i (position pos0 + i) sees keys 0..pos0 + i.
        mask = None
        if t > 1:
            mask = torch.ones(t, end, dtype=torch.bool, device=self.device).tril(diagonal=pos0)
        for layer in self.layers:
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            q, k, v = layer.qkv(h, cos, sin, cfg.rms_norm_eps)
            layer.k_cache[:, :, pos0:end] = k
            layer.v_cache[:, :, pos0:end] = v
            keys, values = layer.k_cache[:, :, :end], layer.v_cache[:, :, :end]  # [1, kv, end, hd]
            g = layer.n_heads // layer.n_kv
            if g > 1:
                keys = keys.repeat_interleave(g, dim=1)  # query head i reads kv head i // g
                values = values.repeat_interleave(g, dim=1)
            a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [1, h, T, hd]
            a = a.transpose(1, 2).reshape(1, t, layer.n_heads * layer.hd)
            x = x + self._reduce(matmul(a, layer.wo, self._bias_once(layer.bo)))
            h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            x = x + self._reduce(self._mlp(layer, h))
        x = rms_norm(x if all_logits else x[:, -1:], self.norm, cfg.rms_norm_eps)
        logits = self._gather(F.linear(x, self.head)).float()  # [1, T or 1, V]
        return logits[0] if all_logits else logits[0, -1]

    # ---- THE decode step: one token with device-side positions (CUDA-graph capturable) -------------
    def decode_step(self, tok: torch.Tensor, pos: torch.Tensor, window: int,
                    blocks: tuple | None = None) -> torch.Tensor:
        """tok [1] and pos [1] (device int64) -> float32 logits [V]. The one decode step: the runner, the
        ranks, `generate` and the benches all call this (eagerly, or replayed from a CUDA graph by
        engine/core/runner.py's Decoder). Attention reads cache positions [0, window): no shape depends on pos,
        so one graph per window serves every position below it.

        Per layer: attn_block (residual add, norm, QKV, RoPE, cache write, attention, o_proj of this rank's
        heads) -> allreduce -> mlp_block (residual add, norm, gate/up, down of this rank's columns) ->
        allreduce. Each block starts with the residual add of the previous block's reduced output, so the
        add fuses with the norm when the blocks are compiled. ``blocks``: (attn_block, mlp_block) to use,
        e.g. torch.compile'd ones (engine.core.runner.kernels); None = the plain functions below.
        Call it under torch.inference_mode()."""
        attn, mlp = blocks or (attn_block, mlp_block)
        cfg = self.cfg
        x = F.embedding(tok.view(1, 1), self.embed)  # [1, 1, D]
        cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)  # [1, hd]
        # additive mask, float32: 0 up to pos, -inf past it; made once per step for every layer
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        mask_bias = torch.where(torch.arange(window, device=self.device) <= pos, zero, float("-inf"))
        mask_bias = mask_bias.view(1, 1, 1, window)  # [1, 1, 1, W]
        delta = torch.zeros_like(x)
        xs = self.epilogue_exchange(blocks)
        if xs is not None:
            from engine.allreduce import epilogue

            recv = xs.receive if epilogue.requested() == "send" else (lambda sent: sent)  # gemv: the GEMV receives
        for i, layer in enumerate(self.layers):
            kw = {} if xs is None else {"send": xs.ticket(2 * i, cfg.hidden_size, self.dtype)}
            x, part = attn(x, delta, cos, sin, pos, mask_bias, *layer.attn_tensors(self.rank), n_heads=layer.n_heads,
                           n_kv=layer.n_kv, hd=layer.hd, eps=cfg.rms_norm_eps, window=window, **kw)
            delta = recv(part) if xs is not None else self._reduce(part)
            kw = {} if xs is None else {"send": xs.ticket(2 * i + 1, cfg.hidden_size, self.dtype)}
            x, part = mlp(x, delta, *layer.mlp_tensors(self.rank), eps=cfg.rms_norm_eps, **kw)
            last = i + 1 == len(self.layers)  # the last exchange is summed by xs.finish (it bumps the serial)
            delta = self._reduce(part) if xs is None else part if last else recv(part)
        if xs is not None:  # the final norm in the last exchange's kernel (rows of up to 8192: epilogue_exchange)
            x = xs.finish(delta, x, self.norm, cfg.rms_norm_eps)
        else:
            x = rms_norm(x + delta, self.norm, cfg.rms_norm_eps)
        return self._gather(F.linear(x, self.head)).float()[0, -1]  # [V]

    def epilogue_exchange(self, blocks: tuple | None):
        """The exchange sent from the GEMVs (engine.allreduce.epilogue) when these blocks take it, the path offers
        it and the exchange mode (V100PLAN_ENGINE_EXCHANGE, else its DEFAULT) is not "kernel"; else None."""
        if self.comm is None or not blocks or not getattr(blocks[0], "sends", False):
            return None
        make = getattr(getattr(self.comm, "path", None), "epilogue", None)
        if make is None:
            return None
        from engine.allreduce import epilogue
        from engine.core import attention

        if epilogue.requested() == "kernel" or not attention.sends_here(self) or self.cfg.hidden_size > 8192:
            return None
        return make()

    def weight_bytes(self) -> int:
        """Bytes this rank reads per decode step from weights (embedding: one row, not the table)."""
        n = self.head.numel() + self.norm.numel() + self.cfg.hidden_size
        for layer in self.layers:
            n += sum(t.numel() for k, t in layer.tensors().items()
                     if t is not None and k not in ("k_cache", "v_cache"))
        return n * self.head.element_size() + sum(p.nbytes for p in self.packed())

    def packed(self) -> list:
        """The packed (GPTQ / AWQ) matrices of this rank (engine.core.quant.PackedLinear)."""
        return [w for layer in self.layers for w in vars(layer).values() if hasattr(w, "qweight")]

    def weights_info(self) -> dict:
        """What `generate --json` and the rank's ready message report: the weight format and the bytes this rank
        holds for weights (every tensor but the K/V cache; packed matrices as their packed tensors)."""
        q = self.cfg.quantization
        dense = [self.embed, self.head, self.norm] + [t for layer in self.layers for k, t in layer.tensors().items()
                                                      if t is not None and k not in ("k_cache", "v_cache")]
        held = sum(t.numel() * t.element_size() for t in dense) + sum(p.nbytes for p in self.packed())
        fmt = str(self.dtype).removeprefix("torch.") if q is None else f"{q.format} ({str(self.dtype)[6:]} dense)"
        return {"format": fmt, "bytes": held, "packed_matrices": len(self.packed())}
