"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention). Weights: w_in (in_proj_qkv | z | b | a in one matrix),
the depthwise conv [channels, kernel], A_log, dt_bias, the gated norm, w_out. State: a pool of conv rings
[slots, channels, kernel] (slot p % kernel = the input of position p) in the dtype and recurrent states
[slots, value heads, dk, dv] float32: fixed size per sequence. TP2: key and value heads split (q/k/v conv
channels, b/a rows, A_log, dt_bias follow), out_proj into the exchange. Decode: the torch form (engine.kernels.gdn)
or (kernel choice "fused", engine.kernels.decode) norm + projection GEMV, the decode kernel, out_proj GEMV. Prefill:
engine.kernels.gdn.chunked, or engine.kernels.gdn_chunk's two kernels under "fused"."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.core.config import ModelConfig
from engine.core.quant import matmul
from engine.kernels import decode, gdn
from engine.model import base
from engine.model.base import Block, Chunk, Step, add_rms_norm, rms_norm


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's gated RMSNorm over each value head: RMSNorm(o) * weight * SiLU(z), Hugging Face's rounding
    (statistics in float32, the normalised row rounded before the weight, the gate in float32)."""
    h = o.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(o.dtype)
    return (h * F.silu(z.float())).to(o.dtype)


def gdn_mix(proj, conv_ring, conv_w, a_log, dt_bias, gnorm, rec_state, pos, *, nk: int, nv: int, dk: int, dv: int,
            eps: float) -> torch.Tensor:
    """One token's work between a Gated DeltaNet layer's projections (the signature of
    engine.kernels.decode.gdn_decode, in torch): proj [conv channels | z | b | a] -> y [nv dv] in proj's dtype;
    the conv ring and the recurrent state are updated in place at ``pos`` (device [1])."""
    kd, vd = nk * dk, nv * dv
    mixed, z, b, a = proj.split([2 * kd + vd, vd, nv, nv])
    mixed = gdn.conv_step(mixed, conv_ring, conv_w, pos)
    q, k, v = mixed.split([kd, kd, vd])
    beta = torch.sigmoid(b)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    o = gdn.step(q.view(nk, dk), k.view(nk, dk), v.view(nv, dv), g, beta, rec_state)  # [nv, dv] float32
    return gated_norm(o.to(proj.dtype), z.view(nv, dv), gnorm, eps).reshape(vd)


def gdn_mix_rows(proj, rings, conv_w, a_log, dt_bias, gnorm, recs, pos, slots, *, nk: int, nv: int, dk: int,
                 dv: int, eps: float) -> torch.Tensor:
    """gdn_mix for B sequences: proj [B, conv channels | z | b | a] (row b: the sequence in pool row slots[b] at
    pos[b]) -> y [B, nv dv]; each row's conv ring (rings [slots, C, K]) and recurrent state (recs [slots, nv, dk,
    dv]) updated in place."""
    kd, vd, n = nk * dk, nv * dv, proj.shape[0]
    mixed, z, b, a = proj.split([2 * kd + vd, vd, nv, nv], dim=-1)
    mixed = gdn.conv_rows(mixed, rings, conv_w, pos, slots)
    q, k, v = mixed.split([kd, kd, vd], dim=-1)
    beta = torch.sigmoid(b)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)  # [B, nv]
    state = recs[slots]  # [B, nv, dk, dv]: the rows' states, gathered
    o = gdn.step_rows(q.view(n, nk, dk), k.view(n, nk, dk), v.view(n, nv, dv), g, beta, state)  # [B, nv, dv]
    recs[slots] = state
    return gated_norm(o.to(proj.dtype), z.view(n, nv, dv), gnorm, eps).reshape(n, vd)


class GatedDeltaNet(Block):
    kind = "linear_attention"
    WEIGHTS = ("input_norm", "w_in", "conv_w", "a_log", "dt_bias", "gnorm", "w_out")
    STATE = ("ring_pool", "rec_pool")

    def __init__(self, cfg: ModelConfig, world: int, e: dict, m: dict):
        d = cfg.hidden_size
        self.eps, self.zc = cfg.rms_norm_eps, cfg.zero_centred_norm
        self.input_norm = torch.empty(d, **e)
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
        self._kernel_shape = decode.gdn_supported(self.dk, self.dv)  # the decode kernel holds these heads
        self.w_out = torch.empty(d, self.nv * self.dv, **m)  # columns: this rank's value heads
        self.ring_pool = self.rec_pool = None

    def alloc_state(self, slots: int, max_context: int, dtype: torch.dtype, device, kv_int8: bool) -> None:
        self.ring_pool = torch.zeros(slots, self.conv_channels, self.kernel, dtype=dtype, device=device)
        self.rec_pool = torch.zeros(slots, self.nv, self.dk, self.dv, dtype=torch.float32, device=device)

    @property
    def conv_ring(self):  # [channels, kernel] of the decoding slot
        return None if self.ring_pool is None else self.ring_pool[self.slot]

    @property
    def rec_state(self):  # [nv, dk, dv] float32 of the decoding slot
        return None if self.rec_pool is None else self.rec_pool[self.slot]

    # ---- prefill ---------------------------------------------------------------------------------
    def chunk_kernel(self, c: Chunk, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the chunked rule runs engine.kernels.gdn_chunk's kernel: kernel choice "fused" (as the decode
        step takes engine.kernels.decode.gdn_decode), where the kernels run and the head sizes fit; float32 (the reference
        dtype) keeps the torch form."""
        from engine.kernels import gdn_chunk

        return (c.kernels == "fused" and dtype != torch.float32 and decode.runs_here(device)
                and gdn_chunk.supported(self.dk, self.dv))

    def prefill(self, h: torch.Tensor, c: Chunk) -> torch.Tensor:
        """h [1, T, D] (normed) -> out_proj partial [1, T, D]. The chunk continues the conv ring and recurrent
        state (both reset at position 0: a new sequence). ``c.states`` (the verification of speculative decoding):
        the tokens go through the decode step's recurrence one by one and (conv rings [T, C, K], recurrent states
        [T, nv, dk, dv]) after each position are appended to it."""
        t, pos0 = h.shape[1], c.pos0
        ring, rec = self.conv_ring, self.rec_state
        kd, vd = self.nk * self.dk, self.nv * self.dv
        proj = matmul(h[0], self.w_in)  # [T, conv channels + vd + 2 nv]
        mixed, z, b, a = proj.split([2 * kd + vd, vd, self.nv, self.nv], dim=-1)
        rings = None
        if c.states is not None:  # ring after position pos0 + i: the ring before with slots pos0..pos0 + i written
            rings = ring.clone().expand(t, -1, -1).clone()  # [T, C, K]
            for i in range(t):
                rings[i:, :, (pos0 + i) % self.kernel] = mixed[i].to(rings.dtype)
        mixed = gdn.conv_prefill(mixed, ring, self.conv_w, pos0)
        q, k, v = mixed.split([kd, kd, vd], dim=-1)
        beta = torch.sigmoid(b)
        g = -self.a_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if pos0 == 0:
            rec.zero_()
        if c.states is not None:
            outs, recs = [], []
            for i in range(t):
                outs.append(gdn.step(q[i].view(self.nk, self.dk), k[i].view(self.nk, self.dk),
                                     v[i].view(self.nv, self.dv), g[i], beta[i], rec))
                recs.append(rec.clone())
            o = torch.stack(outs)  # [T, nv, dv] float32
            c.states.append((rings, torch.stack(recs)))
        else:
            chunked = gdn.chunked
            if self.chunk_kernel(c, h.dtype, h.device):
                from engine.kernels import gdn_chunk

                chunked = gdn_chunk.chunked
            o, final = chunked(q.view(t, self.nk, self.dk), k.view(t, self.nk, self.dk),
                               v.view(t, self.nv, self.dv), g, beta, rec)
            rec.copy_(final)
        y = gated_norm(o.to(h.dtype), z.view(t, self.nv, self.dv), self.gnorm, self.eps)
        return matmul(y.reshape(1, t, vd), self.w_out)

    # ---- the decode step ---------------------------------------------------------------------------
    def fused_here(self, device: torch.device, rot: int) -> bool:
        return decode.runs_here(device) and self._kernel_shape

    def mix(self, proj: torch.Tensor, pos: torch.Tensor, fused: bool) -> torch.Tensor:
        """proj [conv channels | z | b | a] (one row) -> y [nv dv]; the decoding slot's ring and state updated
        at pos (engine.kernels.decode.gdn_decode's kernel where ``fused``, else gdn_mix)."""
        fn = decode.gdn_decode if fused else gdn_mix
        return fn(proj, self.conv_ring, self.conv_w, self.a_log, self.dt_bias, self.gnorm, self.rec_state, pos,
                  nk=self.nk, nv=self.nv, dk=self.dk, dv=self.dv, eps=self.eps)

    def decode(self, x: torch.Tensor, delta: torch.Tensor, s: Step, send=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x, delta [1, 1, D] -> (x + delta, out_proj partial [1, 1, D]). One token: the conv ring and the
        recurrent state are updated in place at s.pos; nothing depends on pos's value on the host (capturable).
        A batched step (``s.slots``) runs decode_rows."""
        if s.slots is not None:
            return self.decode_rows(x, delta, s)
        linear = matmul
        if s.fused and decode.runs_here(x.device):
            linear = decode.linear
            if self.fused_here(x.device, 0):
                proj, x = decode.linear_norm(x, delta, self.input_norm, self.eps, self.w_in, None, zc=self.zc)
                y = self.mix(proj, s.pos, True)
                return x, decode.linear_send(y.view(1, 1, -1), self.w_out, None, send)
        x = x + delta
        h = rms_norm(x, self.input_norm, self.eps, self.zc)
        proj = linear(h, self.w_in, None).view(-1)  # [conv channels | z | b | a]
        y = self.mix(proj, s.pos, False)
        return x, linear(y.reshape(1, 1, self.nv * self.dv), self.w_out, None)

    def decode_rows(self, x: torch.Tensor, delta: torch.Tensor, s: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """B sequences at once: x, delta [B, 1, D] (row b: the sequence in slot s.slots[b] at s.pos[b]) -> (x +
        delta, out_proj partial [B, 1, D]); one product over the B rows for each projection, each row's conv ring
        and recurrent state (its slot's) updated: where the kernels run (fused_here), by the one-row decode
        kernel's batched form in place (decode.gdn_decode_rows); else the torch form (gdn_mix_rows)."""
        b = x.shape[0]
        x, h = add_rms_norm(x, delta, self.input_norm, self.eps, self.zc, rows=True)
        proj = matmul(h, self.w_in, None).view(b, -1)  # [B, conv channels | z | b | a]
        kernel = base.ROWS_KERNELS[0] and self.fused_here(x.device, 0)
        fn = decode.gdn_decode_rows if kernel else gdn_mix_rows  # the kernel: in place
        y = fn(proj, self.ring_pool, self.conv_w, self.a_log, self.dt_bias, self.gnorm, self.rec_pool, s.pos,
               s.slots, nk=self.nk, nv=self.nv, dk=self.dk, dv=self.dv, eps=self.eps)
        return x, matmul(y.view(b, 1, self.nv * self.dv), self.w_out, None)
