"""The one-query attention of the decode step in one Triton kernel, and its combine as a kernel of its own
(engine.kernels.decode launches them and says what they compute): per kv head, q/k RMSNorm, RoPE at pos, K/V written
into the cache, the window split over programs (flash-decoding) and the partials combined in a fixed order. ROWS:
the batched step's form, a third grid axis over rows, each row in its own slot of the cache pools (its position,
its window), the same arithmetic per row."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.rounding_jit import normed, rnd


@triton.jit
def _half_idx(HALF: tl.constexpr, ROT: tl.constexpr):
    # The head dimensions the kernel holds as its two halves (x1, x2: RoPE rotates x1[i] with x2[i]). Full
    # rotary: [0, HALF) and [HALF, HD). Partial (Qwen3.5: the first ROT of HD): the rotary pairs (i, i + ROT/2)
    # first, then the non-rotary dimensions split in two, which cos = 1 and sin = 0 leave as they are.
    hs = tl.arange(0, HALF)
    RH: tl.constexpr = ROT // 2
    NR: tl.constexpr = HALF - RH  # half of the non-rotary dimensions
    i1 = tl.where(hs < RH, hs, ROT + (hs - RH))
    i2 = tl.where(hs < RH, hs + RH, ROT + NR + (hs - RH))
    return i1, i2


@triton.jit
def _rope_half(x1, x2, c1, c2, s1, s2, dt: tl.constexpr, EMU: tl.constexpr):
    # q * cos + rotate_half(q) * sin with each product and the sum rounded to the dtype, as eager torch
    a1 = rnd(x1 * c1, dt, EMU).to(tl.float32)
    b1 = rnd(-x2 * s1, dt, EMU).to(tl.float32)
    a2 = rnd(x2 * c2, dt, EMU).to(tl.float32)
    b2 = rnd(x1 * s2, dt, EMU).to(tl.float32)
    return rnd(a1 + b1, dt, EMU), rnd(a2 + b2, dt, EMU)


@triton.jit
def _load_tile(kc_ptr, vc_ptr, kvh, offs, pos, stride_kh, stride_ks, stride_vh, stride_vs, HALF: tl.constexpr,
               HD: tl.constexpr, ROT: tl.constexpr, ksc_ptr, vsc_ptr, stride_sh, INT8: tl.constexpr,
               dt: tl.constexpr, PERMUTE: tl.constexpr = False):
    # K (two halves) and V of cache positions offs, only those written by earlier steps (< pos); an int8
    # cache is dequantised in registers (one float32 scale per position and kv head)
    old = (offs < pos)[:, None]
    i1, i2 = _half_idx(HALF, ROT)
    kp = kc_ptr + kvh * stride_kh + offs[:, None] * stride_ks
    kt1 = tl.load(kp + i1[None, :], mask=old, other=0)
    kt2 = tl.load(kp + i2[None, :], mask=old, other=0)
    vt = tl.load(vc_ptr + kvh * stride_vh + offs[:, None] * stride_vs + tl.arange(0, HD)[None, :], mask=old,
                 other=0)
    ksc = offs.to(tl.float32)  # placeholders without an int8 cache (one return: Triton types every return)
    vsc = ksc
    if INT8:  # the int8 values (exact in 16-bit floats); their scales multiply the scores and the weights
        omask = offs < pos
        ksc = tl.load(ksc_ptr + kvh * stride_sh + offs, mask=omask, other=0.0).to(tl.float32)
        vsc = tl.load(vsc_ptr + kvh * stride_sh + offs, mask=omask, other=0.0).to(tl.float32)
        kt1, kt2, vt = _i8_to(kt1, dt, PERMUTE), _i8_to(kt2, dt, PERMUTE), _i8_to(vt, dt, PERMUTE)
    return kt1, kt2, vt, ksc, vsc


@triton.jit
def _i8_to(x, dt: tl.constexpr, PERMUTE: tl.constexpr):
    """int8 values as dt, exactly. PERMUTE (fp16, the V100's dtype, on a GPU): the byte of x + 128 under an
    fp16 high byte of 0x64 is 1024 + x + 128, so a byte permute and one f16x2 subtraction widen two values
    (Triton's own conversion: a cvt per value, a quarter-rate instruction); otherwise Triton's."""
    if PERMUTE:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 %ta, %tm;
            xor.b32 %ta, $2, 0x80808080;
            mov.b32 %tm, 0x64806480;
            prmt.b32 $0, %ta, 0x64646464, 0x5140;
            prmt.b32 $1, %ta, 0x64646464, 0x7362;
            sub.f16x2 $0, $0, %tm;
            sub.f16x2 $1, $1, %tm;
            }""",
            constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return x.to(dt)


@triton.jit
def _attend(q1, q2, kt1, kt2, vt, offs, pos, k1, k2, v_new, m_i, l_i, acc, scale, dt: tl.constexpr,
            DOT_F32: tl.constexpr, EMU: tl.constexpr, ksc, vsc, ksc_new, vsc_new, INT8: tl.constexpr,
            APART: tl.constexpr = False):
    # one tile of the online softmax. Position pos's K/V come from registers: put into the tile (APART
    # False), or left out of every tile and attended by _attend_new (APART: the tiles go from the cache to
    # the products untouched, which lets an int8 tile be widened in the products' register layout). An int8
    # cache: q . (k s_k) = (q . k) s_k per position, and p . (v s_v) = (p s_v) . v, so the scales cost one
    # multiply per position
    if APART:
        seen = offs < pos
    else:
        seen = offs <= pos
        here = (offs == pos)[:, None]
        kt1 = tl.where(here, k1[None, :], kt1)
        kt2 = tl.where(here, k2[None, :], kt2)
        vt = tl.where(here, v_new[None, :], vt)
        if INT8:
            ksc = tl.where(offs == pos, ksc_new, ksc)
            vsc = tl.where(offs == pos, vsc_new, vsc)
    if DOT_F32:  # float32 operands (the dtype's values), exact products
        s = tl.dot(q1.to(tl.float32), tl.trans(kt1.to(tl.float32)), input_precision="ieee")
        s += tl.dot(q2.to(tl.float32), tl.trans(kt2.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q1, tl.trans(kt1))
        s += tl.dot(q2, tl.trans(kt2))
    s = s * scale  # [G_PAD, BLOCK_S], float32
    if INT8:
        s = s * ksc[None, :]
    s = tl.where(seen[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pv = p
    if INT8:
        pv = p * vsc[None, :]
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(rnd(pv, dt, EMU).to(tl.float32), vt.to(tl.float32),
                                            input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(pv.to(dt), vt)
    return m_new, l_i, acc


@triton.jit
def _attend_new(q1, q2, k1, k2, v_new, m_i, l_i, acc, scale, dt: tl.constexpr, EMU: tl.constexpr, ksc_new,
                vsc_new, INT8: tl.constexpr):
    # position pos itself (APART): its score per query head from registers (float32 products of dtype
    # values, as the tiles' products), then one online-softmax step with its p rounded to the dtype
    s = (tl.sum(q1.to(tl.float32) * k1.to(tl.float32)[None, :], axis=1)
         + tl.sum(q2.to(tl.float32) * k2.to(tl.float32)[None, :], axis=1)) * scale
    if INT8:
        s = s * ksc_new
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new)
    l_i = l_i * alpha + p
    pv = p
    if INT8:
        pv = p * vsc_new
    pv = rnd(pv, dt, EMU).to(tl.float32)
    acc = acc * alpha[:, None] + pv[:, None] * v_new.to(tl.float32)[None, :]
    return m_new, l_i, acc


@triton.jit
def _combine(kvh, part_acc, part_ml, out_ptr, gate_ptr, SPLITS: tl.constexpr, G: tl.constexpr,
             G_PAD: tl.constexpr, HD: tl.constexpr, EMU: tl.constexpr, GATED: tl.constexpr):
    # the partials of kv head kvh, in split order: m = max, l = sum of exp(s - m), acc = sum of p v
    gs = tl.arange(0, G_PAD)
    ds = tl.arange(0, HD)
    gmask = gs < G
    base = kvh * SPLITS
    m_all = tl.full((G_PAD,), -1.0e30, tl.float32)
    for sp in range(SPLITS):
        m_s = tl.load(part_ml + ((base + sp) * 2) * G_PAD + gs, cache_modifier=".cg")
        m_all = tl.maximum(m_all, m_s)
    l_all = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, HD), tl.float32)
    for sp in range(SPLITS):
        m_s = tl.load(part_ml + ((base + sp) * 2) * G_PAD + gs, cache_modifier=".cg")
        l_s = tl.load(part_ml + ((base + sp) * 2 + 1) * G_PAD + gs, cache_modifier=".cg")
        a_s = tl.load(part_acc + ((base + sp) * G_PAD + gs[:, None]) * HD + ds[None, :], mask=gmask[:, None],
                      other=0.0, cache_modifier=".cg")
        wgt = tl.exp(m_s - m_all)
        l_all += wgt * l_s
        acc += wgt[:, None] * a_s
    o = acc / l_all[:, None]
    odt = out_ptr.dtype.element_ty
    o = rnd(o, odt, EMU)
    if GATED:  # Qwen3.5's output gate: o * sigmoid(gate), the gate from q_proj's rows [query | gate] per head
        gt = tl.load(gate_ptr + (kvh * G + gs[:, None]) * (2 * HD) + HD + ds[None, :], mask=gmask[:, None],
                     other=0.0).to(tl.float32)
        sg = rnd(1.0 / (1.0 + tl.exp(-gt)), odt, EMU).to(tl.float32)
        o = rnd(o.to(tl.float32) * sg, odt, EMU)
    optr = out_ptr + (kvh * G + gs[:, None]) * HD + ds[None, :]
    tl.store(optr, o, mask=gmask[:, None])


@triton.jit
def attention_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, qn_ptr, kn_ptr, kc_ptr, vc_ptr, out_ptr,
                     part_acc, part_ml, count_ptr, eps, scale, stride_kh, stride_ks, stride_vh, stride_vs,
                     N_HEADS: tl.constexpr, N_KV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                     HD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_S: tl.constexpr, SPLITS: tl.constexpr,
                     QK_NORM: tl.constexpr, DOT_F32: tl.constexpr, ONE_KERNEL: tl.constexpr,
                     EMU: tl.constexpr, ROT: tl.constexpr = 0, GATED: tl.constexpr = False,
                     ZC: tl.constexpr = False, ksc_ptr=None, vsc_ptr=None, stride_sh=0,
                     INT8: tl.constexpr = False, APART: tl.constexpr = False,
                     PERMUTE: tl.constexpr = False, slot_ptr=None, row_qkv=0, row_cs=0, slot_k=0, slot_v=0,
                     slot_s=0, ROWS: tl.constexpr = False):
    kvh = tl.program_id(0)
    sp = tl.program_id(1)
    dt = qkv_ptr.dtype.element_ty
    HALF: tl.constexpr = HD // 2
    if ROWS:  # the batched step: row program_id(2), its qkv / cos / sin / output rows, its slot's caches
        r = tl.program_id(2)
        slot = tl.load(slot_ptr + r).to(tl.int64)
        pos = tl.load(pos_ptr + r).to(tl.int32)
        qkv_ptr += r * row_qkv
        cos_ptr += r * row_cs
        sin_ptr += r * row_cs
        kc_ptr += slot * slot_k
        vc_ptr += slot * slot_v
        if INT8:
            ksc_ptr += slot * slot_s
            vsc_ptr += slot * slot_s
        out_ptr += r * (N_HEADS * HD)
        part_acc += r * (N_KV * SPLITS * G_PAD * HD)
        part_ml += r * (N_KV * SPLITS * 2 * G_PAD)
        count_ptr += r * N_KV
    else:
        pos = tl.load(pos_ptr).to(tl.int32)
    # this program's first tile of the cache first: its loads are in flight during the q/k work below
    lo = sp * CHUNK
    offs = lo + tl.arange(0, BLOCK_S)
    RT: tl.constexpr = HD if ROT == 0 else ROT  # the rotary part of each head
    QS: tl.constexpr = 2 * HD if GATED else HD  # q_proj's rows per head ([query | gate] when gated)
    kt1, kt2, vt, ksc_t, vsc_t = _load_tile(kc_ptr, vc_ptr, kvh, offs, pos, stride_kh, stride_ks, stride_vh,
                                            stride_vs, HALF, HD, RT, ksc_ptr, vsc_ptr, stride_sh, INT8, dt, PERMUTE)
    hs = tl.arange(0, HALF)
    i1, i2 = _half_idx(HALF, RT)
    gs = tl.arange(0, G_PAD)
    gmask = gs < G
    # this kv head's q rows [G_PAD, HALF] x 2 halves, its k and v rows [HALF] x 2 / [HD]
    qrow = (kvh * G + gs[:, None]) * QS
    q1 = tl.load(qkv_ptr + qrow + i1[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(qkv_ptr + qrow + i2[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    krow = N_HEADS * QS + kvh * HD
    k1 = tl.load(qkv_ptr + krow + i1).to(tl.float32)
    k2 = tl.load(qkv_ptr + krow + i2).to(tl.float32)
    vrow = N_HEADS * QS + N_KV * HD + kvh * HD
    ds = tl.arange(0, HD)
    v_new = tl.load(qkv_ptr + vrow + ds)
    if QK_NORM:
        qw1 = tl.load(qn_ptr + i1).to(tl.float32)
        qw2 = tl.load(qn_ptr + i2).to(tl.float32)
        kw1 = tl.load(kn_ptr + i1).to(tl.float32)
        kw2 = tl.load(kn_ptr + i2).to(tl.float32)
        rq = 1.0 / tl.sqrt((tl.sum(q1 * q1, axis=1) + tl.sum(q2 * q2, axis=1)) / HD + eps)  # [G_PAD]
        q1 = normed(q1, rq[:, None], qw1[None, :], dt, EMU, ZC).to(tl.float32)
        q2 = normed(q2, rq[:, None], qw2[None, :], dt, EMU, ZC).to(tl.float32)
        rk = 1.0 / tl.sqrt((tl.sum(k1 * k1, axis=0) + tl.sum(k2 * k2, axis=0)) / HD + eps)
        k1 = normed(k1, rk, kw1, dt, EMU, ZC).to(tl.float32)
        k2 = normed(k2, rk, kw2, dt, EMU, ZC).to(tl.float32)
    # cos / sin of the rotary pairs; 1 and 0 for the dimensions a partial rotary leaves alone
    RH: tl.constexpr = RT // 2
    rmask = hs < RH
    c1 = tl.load(cos_ptr + hs, mask=rmask, other=1.0).to(tl.float32)
    c2 = tl.load(cos_ptr + RH + hs, mask=rmask, other=1.0).to(tl.float32)
    s1 = tl.load(sin_ptr + hs, mask=rmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + RH + hs, mask=rmask, other=0.0).to(tl.float32)
    q1, q2 = _rope_half(q1, q2, c1[None, :], c2[None, :], s1[None, :], s2[None, :], dt, EMU)  # dtype
    k1, k2 = _rope_half(k1, k2, c1, c2, s1, s2, dt, EMU)  # dtype
    if INT8:  # quantised per position and kv head: scale = max |x| / 127, x / scale rounded half up
        kf1, kf2, vf = k1.to(tl.float32), k2.to(tl.float32), v_new.to(tl.float32)
        ksc = tl.maximum(tl.maximum(tl.max(tl.abs(kf1), axis=0), tl.max(tl.abs(kf2), axis=0)), 1e-30) / 127.0
        vsc = tl.maximum(tl.max(tl.abs(vf), axis=0), 1e-30) / 127.0
        kq1 = tl.minimum(tl.maximum(tl.floor(kf1 / ksc + 0.5), -127.0), 127.0)
        kq2 = tl.minimum(tl.maximum(tl.floor(kf2 / ksc + 0.5), -127.0), 127.0)
        vq = tl.minimum(tl.maximum(tl.floor(vf / vsc + 0.5), -127.0), 127.0)
        if sp == 0:
            tl.store(kc_ptr + kvh * stride_kh + pos * stride_ks + i1, kq1.to(tl.int8))
            tl.store(kc_ptr + kvh * stride_kh + pos * stride_ks + i2, kq2.to(tl.int8))
            tl.store(vc_ptr + kvh * stride_vh + pos * stride_vs + ds, vq.to(tl.int8))
            tl.store(ksc_ptr + kvh * stride_sh + pos, ksc)
            tl.store(vsc_ptr + kvh * stride_sh + pos, vsc)
        # this position attends to its own K/V as the cache will hold them (as the plain blocks do)
        k1, k2, v_new = kq1.to(dt), kq2.to(dt), vq.to(dt)
        ksc_new, vsc_new = ksc, vsc
    else:
        ksc_new, vsc_new = scale, scale
        if sp == 0:  # one program per kv head writes this position's K/V; nobody reads them back
            tl.store(kc_ptr + kvh * stride_kh + pos * stride_ks + i1, k1)
            tl.store(kc_ptr + kvh * stride_kh + pos * stride_ks + i2, k2)
            tl.store(vc_ptr + kvh * stride_vh + pos * stride_vs + ds, v_new)

    m_i = tl.full((G_PAD,), -1.0e30, tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, HD), tl.float32)
    n_t = tl.minimum(CHUNK, pos - lo + 1)
    if lo <= pos:
        m_i, l_i, acc = _attend(q1, q2, kt1, kt2, vt, offs, pos, k1, k2, v_new, m_i, l_i, acc, scale, dt,
                                DOT_F32, EMU, ksc_t, vsc_t, ksc_new, vsc_new, INT8, APART)
    # the rest of this program's part of the window, up to pos: a loop bound, no branch inside, so the
    # compiler pipelines the tile loads (the launch's num_stages: STAGES)
    for t in range(BLOCK_S, n_t, BLOCK_S):
        offs = lo + t + tl.arange(0, BLOCK_S)
        kt1, kt2, vt, ksc_t, vsc_t = _load_tile(kc_ptr, vc_ptr, kvh, offs, pos, stride_kh, stride_ks,
                                                stride_vh, stride_vs, HALF, HD, RT, ksc_ptr, vsc_ptr,
                                                stride_sh, INT8, dt, PERMUTE)
        m_i, l_i, acc = _attend(q1, q2, kt1, kt2, vt, offs, pos, k1, k2, v_new, m_i, l_i, acc, scale, dt,
                                DOT_F32, EMU, ksc_t, vsc_t, ksc_new, vsc_new, INT8, APART)
    if APART:
        if (lo <= pos) & (pos < lo + CHUNK):  # the program whose part of the window holds pos
            m_i, l_i, acc = _attend_new(q1, q2, k1, k2, v_new, m_i, l_i, acc, scale, dt, EMU, ksc_new, vsc_new,
                                        INT8)
    # this program's partial
    pidx = kvh * SPLITS + sp
    tl.store(part_acc + (pidx * G_PAD + gs[:, None]) * HD + ds[None, :], acc, mask=gmask[:, None])
    tl.store(part_ml + (pidx * 2) * G_PAD + gs, m_i)
    tl.store(part_ml + (pidx * 2 + 1) * G_PAD + gs, l_i)
    if ONE_KERNEL:
        # the last of this kv head's programs to arrive combines (the counter goes back to 0 for the next call)
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + kvh, 1, sem="acq_rel")
        if done == SPLITS - 1:
            tl.debug_barrier()
            _combine(kvh, part_acc, part_ml, out_ptr, qkv_ptr, SPLITS, G, G_PAD, HD, EMU, GATED)
            tl.atomic_xchg(count_ptr + kvh, 0)


@triton.jit
def combine_kernel(part_acc, part_ml, out_ptr, gate_ptr, SPLITS: tl.constexpr, G: tl.constexpr,
                   G_PAD: tl.constexpr, HD: tl.constexpr, EMU: tl.constexpr, GATED: tl.constexpr = False):
    _combine(tl.program_id(0), part_acc, part_ml, out_ptr, gate_ptr, SPLITS, G, G_PAD, HD, EMU, GATED)
