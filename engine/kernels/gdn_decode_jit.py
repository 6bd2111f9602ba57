"""A Gated DeltaNet layer's decode step between its two GEMVs in one kernel (engine.kernels.decode launches it and
says what it computes): one program per value head, the causal conv over the ring, the gates, the delta rule on
the float32 state and the gated RMSNorm; engine.kernels.gdn's ``step`` is its torch reference. ROWS: the batched
step's form (decode.gdn_decode_rows), one program per (value head, row): row r's projection, its slot's ring and
state in the pools (slot_ptr[r]), its position pos_ptr[r], in place; the same arithmetic per row."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.rounding_jit import rnd


@triton.jit
def _conv(proj_ptr, ring_ptr, cw_ptr, ch, pos, WRITE, KSIZE: tl.constexpr, dt: tl.constexpr,
          EMU: tl.constexpr):
    # SiLU(causal conv) of channels ch at pos: taps pos-K+1 .. pos-1 from the ring, pos from the projection
    x = tl.load(proj_ptr + ch)
    acc = x.to(tl.float32) * tl.load(cw_ptr + ch * KSIZE + KSIZE - 1).to(tl.float32)
    for j in range(KSIZE - 1):
        p = pos - (KSIZE - 1) + j
        slot = ((p % KSIZE) + KSIZE) % KSIZE
        tap = tl.load(ring_ptr + ch * KSIZE + slot).to(tl.float32)
        acc += tap * tl.load(cw_ptr + ch * KSIZE + j).to(tl.float32)
    if WRITE:
        tl.store(ring_ptr + ch * KSIZE + pos % KSIZE, x)
    c = rnd(acc, dt, EMU).to(tl.float32)
    return rnd(c / (1.0 + tl.exp(-c)), dt, EMU).to(tl.float32)


@triton.jit
def gdn_decode_kernel(proj_ptr, ring_ptr, cw_ptr, alog_ptr, dtb_ptr, gn_ptr, state_ptr, y_ptr, pos_ptr, eps,
                      NK: tl.constexpr, NV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      KSIZE: tl.constexpr, EMU: tl.constexpr, slot_ptr=None, proj_stride=0,
                      ROWS: tl.constexpr = False):
    h = tl.program_id(0)  # value head
    dt = y_ptr.dtype.element_ty
    RATIO: tl.constexpr = NV // NK
    kh = h // RATIO
    KD: tl.constexpr = NK * DK
    VD: tl.constexpr = NV * DV
    if ROWS:  # row program_id(1): its projection and output rows, its slot's ring and state in the pools
        r = tl.program_id(1)
        slot = tl.load(slot_ptr + r).to(tl.int64)
        pos = tl.load(pos_ptr + r).to(tl.int32)
        proj_ptr += r * proj_stride
        y_ptr += r * VD
        ring_ptr += slot * ((2 * KD + VD) * KSIZE)
        state_ptr += slot * (NV * DK * DV)
    else:
        pos = tl.load(pos_ptr).to(tl.int32)
    ks = tl.arange(0, DK)
    vs = tl.arange(0, DV)
    first = (h % RATIO) == 0  # one program per key head writes the q/k channels' ring slot
    q = _conv(proj_ptr, ring_ptr, cw_ptr, kh * DK + ks, pos, first, KSIZE, dt, EMU)
    k = _conv(proj_ptr, ring_ptr, cw_ptr, KD + kh * DK + ks, pos, first, KSIZE, dt, EMU)
    v = _conv(proj_ptr, ring_ptr, cw_ptr, 2 * KD + h * DV + vs, pos, True, KSIZE, dt, EMU)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    zb = 2 * KD + VD  # z, then b, then a
    b = tl.load(proj_ptr + zb + VD + h).to(tl.float32)
    a = tl.load(proj_ptr + zb + VD + NV + h).to(tl.float32)
    beta = rnd(1.0 / (1.0 + tl.exp(-b)), dt, EMU).to(tl.float32)
    xa = a + tl.load(dtb_ptr + h).to(tl.float32)
    ex = tl.exp(tl.minimum(xa, 20.0))
    sp = tl.where(xa > 20.0, xa, tl.where(xa < -15.0, ex, tl.log(1.0 + ex)))  # softplus as torch's (log1p)
    g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * sp
    sptr = state_ptr + h * DK * DV + ks[:, None] * DV + vs[None, :]
    s = tl.load(sptr) * tl.exp(g)  # [DK, DV] float32
    kv = tl.sum(s * k[:, None], axis=0)  # [DV]
    s = s + k[:, None] * ((v - kv) * beta)[None, :]
    tl.store(sptr, s)
    o = rnd(tl.sum(s * q[:, None], axis=0), dt, EMU).to(tl.float32)  # [DV], rounded as HF's core_attn_out
    # gated RMSNorm: weight * RMSNorm(o) (rounded), times SiLU(z) in float32, rounded
    rs = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps)
    hn = rnd(rnd(o * rs, dt, EMU).to(tl.float32) * tl.load(gn_ptr + vs).to(tl.float32), dt, EMU).to(tl.float32)
    z = tl.load(proj_ptr + zb + h * DV + vs).to(tl.float32)
    tl.store(y_ptr + h * DV + vs, rnd(hn * (z / (1.0 + tl.exp(-z))), dt, EMU))
