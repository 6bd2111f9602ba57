"""The chunked gated delta rule's prefill kernels (engine.kernels.gdn_chunk launches them and says what they compute):
``gdn_chunk_prep_kernel``, the intra-chunk parts of every chunk at once, and ``gdn_chunk_kernel``, the sequential
walk over the chunks with the state in registers; engine.kernels.gdn is their torch reference."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.rounding_jit import rnd


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, EMU: tl.constexpr):
    # EMU: Triton's interpreter has no bf16 product; the bf16 values are exact in float32
    if EMU:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _block(ptr, r: tl.constexpr, c: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    bs = tl.arange(0, B)
    return tl.load(ptr + (r * B + bs[:, None]) * C + c * B + bs[None, :])


@triton.jit
def _put(ptr, x, r: tl.constexpr, c: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    bs = tl.arange(0, B)
    tl.store(ptr + (r * B + bs[:, None]) * C + c * B + bs[None, :], x)


@triton.jit
def _mm(a, b):  # the 16 x 16 blocks of the inverse: float32 products
    return tl.dot(a, b, input_precision="ieee")


# T (the chunk's tokens) and N (its 64-token chunks) change from one prefill call to the next: Triton would
# compile a kernel per divisibility of each (a multiple of 16 or not, N == 1 or not), so the first follow-up turn
# of a length the service had not seen paid ~1.4 s of compilation (one H200, 2026-12-02: 1.84 s against 0.40 s)
@triton.jit(do_not_specialize=["T", "N"])
def gdn_chunk_prep_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, u_ptr, w_ptr, qd_ptr, kd_ptr, attn_ptr, last_ptr,
                          scr_ptr, T, N, stride_q, stride_k, stride_v, NV: tl.constexpr, RATIO: tl.constexpr,
                          DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, IEEE: tl.constexpr,
                          EMU: tl.constexpr):
    # one (value head, chunk): the intra-chunk parts of engine.kernels.gdn.chunk_parts in registers, the UT
    # transform's (I + A)^-1 through the chunk's scratch tile [C, C] (float32): the four 16 x 16 diagonal
    # blocks by forward substitution (15 steps), the blocks below them by products
    B: tl.constexpr = 16
    NB: tl.constexpr = C // B
    h = tl.program_id(0)
    i = tl.program_id(1)
    kh = h // RATIO
    dt = u_ptr.dtype.element_ty
    cs = tl.arange(0, C)
    ks = tl.arange(0, DK)
    vs = tl.arange(0, DV)
    ts = i * C + cs
    ok = ts < T  # the last chunk's padding: zero q, k, v, g and beta, as chunk_parts pads
    q = tl.load(q_ptr + ts[:, None] * stride_q + kh * DK + ks[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    k = tl.load(k_ptr + ts[:, None] * stride_k + kh * DK + ks[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    v = tl.load(v_ptr + ts[:, None] * stride_v + h * DV + vs[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    g = tl.load(g_ptr + ts * NV + h, mask=ok, other=0.0)
    beta = tl.load(beta_ptr + ts * NV + h, mask=ok, other=0.0)
    q = q / tl.sqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None] * (1.0 / tl.sqrt(DK * 1.0))
    k = k / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    cum = tl.cumsum(g, 0)
    causal = cs[:, None] >= cs[None, :]
    decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
    # the products of the parts in float32 (tf32 tensor cores on Ampere and later, IEEE for a float32 model)
    kt = tl.trans(k)
    a = tl.where(cs[:, None] > cs[None, :], _dot(k, kt, IEEE, False) * beta[:, None] * decay, 0.0)
    row = (h * N + i) * C + cs
    tl.store(attn_ptr + row[:, None] * C + cs[None, :], rnd(_dot(q, kt, IEEE, False) * decay, dt, EMU))
    scr = scr_ptr + (h * N + i).to(tl.int64) * C * C
    tl.store(scr + cs[:, None] * C + cs[None, :], a)
    tl.debug_barrier()
    bi = tl.arange(0, NB)
    bj = tl.arange(0, B)
    eye = (bj[:, None] == bj[None, :]).to(tl.float32)
    x3 = tl.zeros((NB, B, B), tl.float32) + eye[None, :, :]  # the diagonal blocks' inverses, row by row
    for r in range(1, B):
        ar = tl.load(scr + (bi[:, None] * B + r) * C + bi[:, None] * B + bj[None, :], mask=bj[None, :] < r,
                     other=0.0)  # [NB, B]: row r of each diagonal block, left of the diagonal
        x3 = tl.where(bj[None, :, None] == r, x3 - tl.sum(ar[:, :, None] * x3, axis=1)[:, None, :], x3)
    tl.store(scr + (bi[:, None, None] * B + bj[None, :, None]) * C + bi[:, None, None] * B + bj[None, None, :], x3)
    tl.debug_barrier()
    a10 = _block(scr, 1, 0, B, C)
    a20 = _block(scr, 2, 0, B, C)
    a21 = _block(scr, 2, 1, B, C)
    a30 = _block(scr, 3, 0, B, C)
    a31 = _block(scr, 3, 1, B, C)
    a32 = _block(scr, 3, 2, B, C)
    x00 = _block(scr, 0, 0, B, C)
    x11 = _block(scr, 1, 1, B, C)
    x22 = _block(scr, 2, 2, B, C)
    x33 = _block(scr, 3, 3, B, C)
    x10 = -_mm(x11, _mm(a10, x00))  # X_ij = -X_ii sum_{j <= m < i} A_im X_mj
    x21 = -_mm(x22, _mm(a21, x11))
    x20 = -_mm(x22, _mm(a20, x00) + _mm(a21, x10))
    x32 = -_mm(x33, _mm(a32, x22))
    x31 = -_mm(x33, _mm(a31, x11) + _mm(a32, x21))
    x30 = -_mm(x33, _mm(a30, x00) + _mm(a31, x10) + _mm(a32, x20))
    tl.debug_barrier()
    _put(scr, x10, 1, 0, B, C)
    _put(scr, x20, 2, 0, B, C)
    _put(scr, x21, 2, 1, B, C)
    _put(scr, x30, 3, 0, B, C)
    _put(scr, x31, 3, 1, B, C)
    _put(scr, x32, 3, 2, B, C)
    tl.debug_barrier()
    x = tl.load(scr + cs[:, None] * C + cs[None, :])  # (I + A)^-1, zero above the diagonal
    tl.store(u_ptr + row[:, None] * DV + vs[None, :], rnd(_dot(x, v * beta[:, None], IEEE, False), dt, EMU))
    eg = tl.exp(cum)
    tl.store(w_ptr + row[:, None] * DK + ks[None, :],
             rnd(_dot(x, k * (beta * eg)[:, None], IEEE, False), dt, EMU))
    tl.store(qd_ptr + row[:, None] * DK + ks[None, :], rnd(q * eg[:, None], dt, EMU))
    last = tl.sum(g, axis=0)
    tl.store(kd_ptr + row[:, None] * DK + ks[None, :], rnd(k * tl.exp(last - cum)[:, None], dt, EMU))
    tl.store(last_ptr + h * N + i, tl.exp(last))


@triton.jit(do_not_specialize=["N"])
def gdn_chunk_kernel(u_ptr, w_ptr, qd_ptr, kd_ptr, attn_ptr, last_ptr, state_ptr, out_ptr, N,
                     DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                     IEEE: tl.constexpr, EMU: tl.constexpr):
    h = tl.program_id(0).to(tl.int64)  # value head
    ks = tl.arange(0, DK)
    vs = tl.program_id(1) * BV + tl.arange(0, BV)
    cs = tl.arange(0, C)
    dt = u_ptr.dtype.element_ty
    sptr = state_ptr + h * DK * DV + ks[:, None] * DV + vs[None, :]
    s = tl.load(sptr)  # [DK, BV] float32
    for i in range(N):
        row = (h * N + i) * C + cs  # the chunk's C tokens
        sd = rnd(s, dt, EMU)
        w = tl.load(w_ptr + row[:, None] * DK + ks[None, :])  # [C, DK]
        vn = tl.load(u_ptr + row[:, None] * DV + vs[None, :]).to(tl.float32) - _dot(w, sd, IEEE, EMU)  # [C, BV]
        vnd = rnd(vn, dt, EMU)
        qd = tl.load(qd_ptr + row[:, None] * DK + ks[None, :])  # [C, DK]
        at = tl.load(attn_ptr + row[:, None] * C + cs[None, :])  # [C, C]
        tl.store(out_ptr + row[:, None] * DV + vs[None, :], _dot(qd, sd, IEEE, EMU) + _dot(at, vnd, IEEE, EMU))
        kdt = tl.load(kd_ptr + row[None, :] * DK + ks[:, None])  # [DK, C]: kd transposed by the load
        s = s * tl.load(last_ptr + h * N + i) + _dot(kdt, vnd, IEEE, EMU)
    tl.store(sptr, s)
