"""Full attention (Llama / Qwen2 / Qwen3) and gated attention (Qwen3.5: q_proj's rows [query | gate] per head,
the output scaled by sigmoid(gate) before o_proj). Weights: wqkv (q | k | v rows), wo, q/k norms. State: the K/V
cache pool [slots, kv heads, context, head dim] (int8 + a float32 scale per position and head with
``--kv-cache-dtype int8``). TP2: heads split (q, gate, k, v rows; o columns), o_proj into the exchange.
Decode: the plain torch form, or (kernel choice "fused", engine.kernels.decode) norm + QKV GEMV, one-query
attention kernel, o_proj GEMV; prefill: engine.core.prefill_attention."""

from __future__ import annotations

import math

import torch

from engine.core import kvquant, prefill_attention
from engine.core.config import ModelConfig
from engine.core.quant import matmul  # F.linear for dense or packed (GPTQ / AWQ) weights
from engine.kernels import decode
from engine.model import base
from engine.model.base import Block, Chunk, Step, add_rms_norm, rms_norm, rope


class FullAttention(Block):
    kind = "full_attention"
    gated = False
    WEIGHTS = ("input_norm", "wqkv", "bqkv", "wo", "bo", "q_norm", "k_norm")
    STATE = ("k_pool", "v_pool", "k_scale_pool", "v_scale_pool")

    def __init__(self, cfg: ModelConfig, world: int, e: dict, m: dict):
        """``e``: dtype and device of dense tensors; ``m``: of the four matrices (meta where a GPTQ / AWQ loader
        places them, engine.core.quant_load)."""
        d = cfg.hidden_size
        self.eps, self.zc = cfg.rms_norm_eps, cfg.zero_centred_norm
        self._kernel_shape: dict[int, bool] = {}  # rotary width -> whether the attention kernel holds the shape
        self.input_norm = torch.empty(d, **e)
        self.n_heads = cfg.num_heads // world
        self.n_kv = cfg.num_kv_heads // world
        self.hd = cfg.head_dim
        self.q_rows = self.n_heads * self.hd * (2 if self.gated else 1)
        qkv = self.q_rows + 2 * self.n_kv * self.hd
        self.wqkv = torch.empty(qkv, d, **m)  # rows: [q heads (each [query | gate] if gated) | k heads | v heads]
        self.bqkv = torch.empty(qkv, **e) if cfg.attention_bias else None
        self.wo = torch.empty(d, self.n_heads * self.hd, **m)  # columns: this rank's heads
        self.bo = torch.empty(d, **e) if cfg.o_bias else None  # added by rank 0 only
        self.q_norm = torch.empty(self.hd, **e) if cfg.qk_norm else None
        self.k_norm = torch.empty(self.hd, **e) if cfg.qk_norm else None
        self.k_pool = self.v_pool = self.k_scale_pool = self.v_scale_pool = None

    # ---- per-sequence state: a pool with a leading slot dimension ----------------------------------
    def alloc_state(self, slots: int, max_context: int, dtype: torch.dtype, device, kv_int8: bool) -> None:
        shape = (slots, self.n_kv, max_context, self.hd)
        dt = torch.int8 if kv_int8 else dtype
        self.k_pool = torch.zeros(shape, dtype=dt, device=device)
        self.v_pool = torch.zeros(shape, dtype=dt, device=device)
        if kv_int8:
            self.k_scale_pool = torch.zeros(shape[:3], dtype=torch.float32, device=device)
            self.v_scale_pool = torch.zeros(shape[:3], dtype=torch.float32, device=device)

    def _of_slot(self, pool):
        return None if pool is None else pool[self.slot:self.slot + 1]

    @property
    def k_cache(self):  # [1, kv, S, hd] of the decoding slot
        return self._of_slot(self.k_pool)

    @property
    def v_cache(self):
        return self._of_slot(self.v_pool)

    @property
    def k_scale(self):  # [1, kv, S] float32 (int8 cache only)
        return self._of_slot(self.k_scale_pool)

    @property
    def v_scale(self):
        return self._of_slot(self.v_scale_pool)

    # ---- prefill ---------------------------------------------------------------------------------
    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, norm=rms_norm):
        """(q [B, h, T, hd], k [B, kv, T, hd], v [B, kv, T, hd], gate [B, T, h hd] or None). ``norm``: the q / k
        norm (rms_norm's signature; the speculative verification passes its one-kernel form)."""
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

    def prefill(self, h: torch.Tensor, c: Chunk) -> torch.Tensor:
        """h [1, T, D] (normed) -> o_proj partial [1, T, D]; the chunk's K/V written."""
        t = h.shape[1]
        pos0, end = c.pos0, c.pos0 + t
        q, k, v, gate = self.qkv(h, c.cos, c.sin, self.eps)
        k_cache, v_cache = self.k_cache, self.v_cache
        if self.k_scale_pool is None:
            k_cache[:, :, pos0:end] = k
            v_cache[:, :, pos0:end] = v
            keys, values = k_cache[:, :, :end], v_cache[:, :, :end]  # [1, kv, end, hd]
        else:  # int8: the chunk attends to its own K/V as the cache holds them, as every later step will
            k_scale, v_scale = self.k_scale, self.v_scale
            kvquant.write(k_cache, k_scale, k, pos0)
            kvquant.write(v_cache, v_scale, v, pos0)
            keys = kvquant.dequantize(k_cache[:, :, :end], k_scale[:, :, :end], q.dtype)
            values = kvquant.dequantize(v_cache[:, :, :end], v_scale[:, :, :end], q.dtype)
        # query head i reads kv head i // g; causal to the lower right, no [T, end] mask on a GPU
        a = prefill_attention.attend(q, keys, values, pos0)  # [1, h, T, hd]
        a = a.transpose(1, 2).reshape(1, t, self.n_heads * self.hd)
        if gate is not None:
            a = a * torch.sigmoid(gate)
        return matmul(a, self.wo, self.bias_once(self.bo, c.rank))

    # ---- the decode step ---------------------------------------------------------------------------
    def fused_here(self, device: torch.device, rot: int) -> bool:
        """Whether the fused path runs this layer's attention as one kernel (and so can carry the TP2 exchange)."""
        held = self._kernel_shape.get(rot)
        if held is None:  # asked once per rotary width (engine.kernels.shapes), not once a token
            held = self._kernel_shape[rot] = (decode.attention_supported(self.hd, self.n_heads, self.n_kv)
                                              and decode.rotary_supported(rot, self.hd))
        return decode.runs_here(device) and held

    def decode(self, x: torch.Tensor, delta: torch.Tensor, s: Step, send=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x, delta [1, 1, D] -> (x + delta, o_proj partial [1, 1, D]); this position's K/V written at s.pos.
        Fused: norm + QKV GEMV, engine.kernels.decode.decode_attention, o_proj GEMV (``send``: an
        engine.allreduce.epilogue.Ticket, o_proj's rows also go to the peer; ``delta`` may be the last Sent).
        A batched step (``s.slots``) runs decode_rows."""
        if s.slots is not None:
            return self.decode_rows(x, delta, s)
        if s.fused and decode.runs_here(x.device):
            if not self.fused_here(x.device, s.cos.shape[-1]):
                return self.decode_plain(x, delta, s, linear=decode.linear)
            qkv, x = decode.linear_norm(x, delta, self.input_norm, self.eps, self.wqkv, self.bqkv, zc=self.zc)
            a = decode.decode_attention(
                qkv, s.cos, s.sin, s.pos, self.q_norm, self.k_norm, self.k_cache, self.v_cache, n_heads=self.n_heads,
                n_kv=self.n_kv, hd=self.hd, eps=self.eps, window=s.window, gated=self.gated, zc=self.zc,
                k_scale=self.k_scale, v_scale=self.v_scale)
            # o_proj through the prologue kernel with or without the send: the two exchanges give the same bits
            return x, decode.linear_send(a, self.wo, self.bias_once(self.bo, s.rank), send)
        return self.decode_plain(x, delta, s)

    def decode_plain(self, x, delta, s: Step, linear=matmul):
        """The torch form: the g query heads of one kv head become g query rows against that kv head (no K/V
        copies), as two batched matrix products that spread the window over the whole GPU (a fused SDPA kernel
        parallelises over the g x kv query rows only and read the cache at ~5 % of the H200's bandwidth, bench
        2026-11-29). ``linear``: F.linear, or engine.kernels.decode.linear where Triton targets the card."""
        n_heads, n_kv, hd, pos, window = self.n_heads, self.n_kv, self.hd, s.pos, s.window
        x = x + delta  # the previous block's reduced output
        h = rms_norm(x, self.input_norm, self.eps, self.zc)
        qkv = linear(h, self.wqkv, self.bqkv)  # [1, 1, (h [x 2 gated] + 2 kv) * hd]
        qn = n_heads * hd * (2 if self.gated else 1)
        q, k, v = qkv.split([qn, n_kv * hd, n_kv * hd], dim=-1)
        gate = None
        if self.gated:
            qg = q.view(1, n_heads, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:].reshape(1, 1, n_heads * hd)
        q = q.reshape(1, n_heads, hd)
        k = k.view(1, n_kv, hd)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, self.eps, self.zc)
            k = rms_norm(k, self.k_norm, self.eps, self.zc)
        q = rope(q, s.cos, s.sin)  # [1, h, hd]
        k = rope(k, s.cos, s.sin)  # [1, kv, hd]
        k_cache, v_cache = self.k_cache, self.v_cache
        if self.k_scale_pool is None:
            k_cache.index_copy_(2, pos, k.view(1, n_kv, 1, hd))
            v_cache.index_copy_(2, pos, v.view(1, n_kv, 1, hd))
            keys, values = k_cache[:, :, :window], v_cache[:, :, :window]  # [1, kv, W, hd]
        else:
            k_scale, v_scale = self.k_scale, self.v_scale
            kvquant.write(k_cache, k_scale, k.view(1, n_kv, 1, hd), pos=pos)
            kvquant.write(v_cache, v_scale, v.reshape(1, n_kv, 1, hd), pos=pos)
            keys = kvquant.dequantize(k_cache[:, :, :window], k_scale[:, :, :window], q.dtype)
            values = kvquant.dequantize(v_cache[:, :, :window], v_scale[:, :, :window], q.dtype)
        qg = q.view(1, n_kv, n_heads // n_kv, hd)  # [1, kv, g, hd]
        sc = torch.matmul(qg, keys.transpose(-1, -2)).float() * (1.0 / math.sqrt(hd)) + s.mask_bias  # [1, kv, g, W]
        p = torch.softmax(sc, dim=-1).to(values.dtype)
        a = torch.matmul(p, values).reshape(1, 1, n_heads * hd)  # [1, 1, h * hd]
        if gate is not None:
            a = a * torch.sigmoid(gate)
        return x, linear(a, self.wo, self.bias_once(self.bo, s.rank))


    def decode_rows(self, x, delta, s: Step):
        """B sequences at once: x, delta [B, 1, D] (row b: the sequence in slot s.slots[b] at position s.pos[b]) ->
        (x + delta, o_proj partial [B, 1, D]). One product over the B rows for QKV and o_proj; each row's K/V
        written into its slot, each row attending over its own slot's positions [0, pos[b]]: where the fused
        kernels run (fused_here), the one-query attention kernel's batched form reads each row's slot in place
        (decode.decode_attention with slots); else the torch form gathers the window per slot (s.mask_bias
        masking each row past its position: a reused slot's older K/V stay unread)."""
        n_heads, n_kv, hd, pos, slots, w = self.n_heads, self.n_kv, self.hd, s.pos, s.slots, s.window
        b = x.shape[0]
        x, h = add_rms_norm(x, delta, self.input_norm, self.eps, self.zc, rows=True)
        qkv = matmul(h, self.wqkv, self.bqkv)  # [B, 1, (h [x 2 gated] + 2 kv) * hd]
        if base.ROWS_KERNELS[0] and self.fused_here(x.device, s.cos.shape[-1]):  # the one-query kernel, per row
            a = decode.decode_attention(
                qkv.view(b, -1), s.cos, s.sin, pos, self.q_norm, self.k_norm, self.k_pool, self.v_pool,
                n_heads=n_heads, n_kv=n_kv, hd=hd, eps=self.eps, window=w, gated=self.gated, zc=self.zc,
                k_scale=self.k_scale_pool, v_scale=self.v_scale_pool, slots=slots)
            return x, matmul(a, self.wo, self.bias_once(self.bo, s.rank))
        q, k, v = qkv.split([self.q_rows, n_kv * hd, n_kv * hd], dim=-1)
        gate = None
        if self.gated:
            qg = q.view(b, n_heads, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:].reshape(b, 1, n_heads * hd)
        q = q.reshape(b, n_heads, hd)
        k = k.view(b, n_kv, hd)
        v = v.view(b, n_kv, hd)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, self.eps, self.zc)
            k = rms_norm(k, self.k_norm, self.eps, self.zc)
        cos, sin = s.cos[:, None], s.sin[:, None]  # [B, 1, rot]
        q, k = rope(q, cos, sin), rope(k, cos, sin)  # [B, h, hd], [B, kv, hd]
        if self.k_scale_pool is None:
            self.k_pool[slots, :, pos] = k  # row b into slot slots[b] at pos[b]
            self.v_pool[slots, :, pos] = v
            keys, values = self.k_pool[slots, :, :w], self.v_pool[slots, :, :w]  # [B, kv, W, hd]
        else:
            for pool, scales, t in ((self.k_pool, self.k_scale_pool, k), (self.v_pool, self.v_scale_pool, v)):
                pool[slots, :, pos], scales[slots, :, pos] = kvquant.quantize(t)
            keys = kvquant.dequantize(self.k_pool[slots, :, :w], self.k_scale_pool[slots, :, :w], q.dtype)
            values = kvquant.dequantize(self.v_pool[slots, :, :w], self.v_scale_pool[slots, :, :w], q.dtype)
        qg = q.view(b, n_kv, n_heads // n_kv, hd)  # [B, kv, g, hd]
        sc = torch.matmul(qg, keys.transpose(-1, -2)).float() * (1.0 / math.sqrt(hd)) + s.mask_bias  # [B, kv, g, W]
        p = torch.softmax(sc, dim=-1).to(values.dtype)
        a = torch.matmul(p, values).reshape(b, 1, n_heads * hd)
        if gate is not None:
            a = a * torch.sigmoid(gate)
        return x, matmul(a, self.wo, self.bias_once(self.bo, s.rank))


class GatedAttention(FullAttention):
    """Qwen3.5's attention (config attn_output_gate): q_proj's rows are [query | gate] per head and the output is
    scaled by sigmoid(gate) before o_proj; the MTP draft layer is one of these."""

    gated = True
