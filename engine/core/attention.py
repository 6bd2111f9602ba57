"""The decode step in five kernels per layer (kernel choice ``fused``): one Triton kernel for the whole
one-query attention, and the residual add + RMSNorm and SiLU(gate) * up folded into the next GEMV.

Per layer, as engine.model.attention.FullAttention and engine.model.mlp.DenseMLP run it under kernel choice
``fused``:

  1. GEMV with a norm prologue (engine.kernels.gemv.linear_norm): h = RMSNorm(x + delta), qkv = h @ Wqkv^T (+ b);
     program 0 also writes x + delta, the new residual.
  2. ``decode_attention``: from the qkv row, per kv head: q/k RMSNorm (Qwen3), RoPE at ``pos``, K/V written
     into the cache at ``pos``, and the attention of the g query heads of that kv head over cache positions
     [0, window) with positions past ``pos`` masked; the window is split over programs (flash-decoding:
     partial max / sum / accumulator in float32), and the last program of a kv head to finish combines the
     partials in a fixed order (one kernel; ``combine="kernel"`` runs the combine as a second kernel).
  3. o_proj GEMV (engine.kernels.gemv.linear).
  4. GEMV with a norm prologue for gate/up (as 1).
  5. GEMV with a SiLU(gate) * up prologue for down (engine.kernels.gemv.linear_silu).

The earlier blocks (torch.compile'd, ``gemv``) ran ~15 kernels per layer; the ~1 ms a step those small
kernels cost does not shrink when tensor parallelism halves the matrices (docs/engine-speed.md).

Rounding follows Hugging Face's (engine.core.model.rms_norm, rotate_half): norm statistics in float32,
the normalised row rounded to the model's dtype before the weight multiply and that product rounded; the
RoPE products and their sum rounded; K and V stored in the dtype. The attention itself keeps the scores,
the softmax and the value sums in float32 (more exact than the two bf16 products the plain blocks run).
Every reduction has a fixed order: the same answer on every rank and every replay.

pos is a device tensor: no shape and no Python value depends on it, so one CUDA graph per window serves
every position below the window. Positions past pos are neither read nor computed (a program whose part
of the window starts past pos only writes an empty partial). The new K/V of position pos are used from
registers, never read back from the cache (no read-after-write between programs).
"""

from __future__ import annotations

import functools
import math

import torch

from engine import tuning

BLOCK_S = 128  # cache positions per tile (H200, 2026-11-30: 128 x 8 warps fastest of 8 configurations)
NUM_WARPS = 8
TARGET_PROGRAMS = 264  # about two programs per SM of an H200 (132 SMs): sets how the window is split
# head dim 256 (Qwen3.5): 64-position tiles and 4 warps: 197 vs 232 us at 128K, 365 vs 419 us at 256K against
# (128, 8) on an H200 (2026-12-01, python -m engine.bench.attention, tests/fixtures/engine/h200-attention-2026-12-01.json)
HD256_CONFIG = (64, 4, 0)
# tiles whose loads a program keeps in flight (the launch's num_stages): 1 = none. Triton's default (3) needs
# 3 x 128 KB of shared memory at head dim 256 and 128-position tiles: more than an H200 has (227 KB).
STAGES = 1
# long windows (>= LONG_WINDOW positions) on cards with cp.async (compute capability >= 8.0): head dim -> (positions
# per tile, warps, num_stages): Triton's pipeline three tiles deep on small tiles. H200, 2026-12-02 (python -m
# engine.bench.attention, tests/fixtures/engine/h200-attention-2026-12-02.json): 27B shape 172.8 / 309.4 us at 128K /
# 256K (74 % / 83 % of read bandwidth) against 196.8 / 364.1 us for HD256_CONFIG; 8B shape 153.1 / 284.2 us (82 % /
# 89 %) against 261.5 / 356.4 us for (BLOCK_S, NUM_WARPS). int8 caches, 2026-12-03 (h200-attention-2026-12-03-apart-*):
# the same blocks with APART were the fastest of the sweep (27B 149.0 us at 128K against 230.6 us before).
LONG_WINDOW = 65536
LONG_CONFIG = {128: (64, 4, 3), 256: (32, 4, 3)}
# the step's own position attended apart from the cache tiles (decode_attention's ``apart``) whenever the loop is
# pipelined (num_stages > 1): the tiles then go from memory to the products untouched, so an int8 tile is widened in
# the products' register layout instead of through shared memory a second time. H200, 2026-12-03
# (tests/fixtures/engine/h200-attention-2026-12-03-apart-*.json, docs/engine-speed.md): with 3 stages 27B bf16 172.2
# -> 154.7 us at 128K, int8 214.5 -> 149.0 us; with 1 stage it loses (194.6 -> 224.8 us), so it is off there
APART = True
# int8 caches in fp16 on a GPU widened by a byte permute (attention._i8_to) instead of Triton's cvt per value:
# exact (tests/engine/test_engine_fused_gpu.py, passed on an H200) and faster there (27B 163.2 -> 149.4 us at 128K)
I8_PERMUTE = True
VOLTA_TILE = 128 * 128  # positions per tile x head dim at most below compute capability 8.0 (engine.core.sm70)


@functools.cache
def _kernels():
    # Triton resolves triton.language and the functions a kernel calls through the module's globals
    global tl, rnd, _normed, _half_idx, _rope_half, _combine, _load_tile, _attend, _attend_new, _i8_to
    import triton
    import triton.language as tl

    from engine.kernels import gemv

    gemv._prologue_kernel()
    rnd = gemv.rnd  # float32 -> dtype, round to nearest even (by hand under the interpreter)
    _normed = gemv._normed  # RMSNorm's rounding (Llama's, or zero-centred)

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
                         PERMUTE: tl.constexpr = False):
        kvh = tl.program_id(0)
        sp = tl.program_id(1)
        dt = qkv_ptr.dtype.element_ty
        HALF: tl.constexpr = HD // 2
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
            q1 = _normed(q1, rq[:, None], qw1[None, :], dt, EMU, ZC).to(tl.float32)
            q2 = _normed(q2, rq[:, None], qw2[None, :], dt, EMU, ZC).to(tl.float32)
            rk = 1.0 / tl.sqrt((tl.sum(k1 * k1, axis=0) + tl.sum(k2 * k2, axis=0)) / HD + eps)
            k1 = _normed(k1, rk, kw1, dt, EMU, ZC).to(tl.float32)
            k2 = _normed(k2, rk, kw2, dt, EMU, ZC).to(tl.float32)
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

    return attention_kernel, combine_kernel


def _interpreting() -> bool:
    # Triton's CPU interpreter multiplies 16-bit float tiles as raw integers (tl.dot gets float32 there) and
    # rounds to bf16 by truncation (the kernels round by hand there: engine.kernels.gemv.rnd)
    from engine.kernels.gemv import interpreting

    return interpreting()


_COUNTERS: dict[tuple, torch.Tensor] = {}


def _counter(k_cache: torch.Tensor, n_kv: int) -> torch.Tensor:
    """One arrival counter per kv head of this cache (zero between calls: the combining program resets it).
    Made on the first call, which every caller runs before capturing a graph."""
    key = (k_cache.device, k_cache.data_ptr(), n_kv)
    c = _COUNTERS.get(key)
    if c is None:
        if k_cache.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode_attention: call it once before capturing a CUDA graph")
        c = _COUNTERS[key] = torch.zeros(n_kv, dtype=torch.int32, device=k_cache.device)
    return c


def splits_for(window: int, n_kv: int, block_s: int = BLOCK_S) -> tuple[int, int]:
    """(programs per kv head, cache positions per program) for a window: about TARGET_PROGRAMS programs in
    all, each over a whole number of tiles."""
    tiles = -(-window // block_s)
    want = max(1, min(tiles, -(-TARGET_PROGRAMS // n_kv)))
    chunk = -(-tiles // want) * block_s
    return -(-window // chunk), chunk


def launch_config(hd: int, window: int, capability: tuple[int, int] | None, *, block_s: int | None = None,
                  num_warps: int | None = None, stages: int | None = None,
                  apart: bool | None = None) -> tuple[int, int, int, int, bool]:
    """(positions per tile, warps, programs per kv head or 0 for splits_for, num_stages, apart) that
    decode_attention launches for head dim ``hd`` over ``window`` positions on a GPU of ``capability`` (None: not
    a GPU, Triton's interpreter); arguments given win over the defaults. 16-bit and int8 caches take the same."""
    table = tuning.active().attention  # a measured (tile, warps, programs) for this card family, or None
    cfg_bs, cfg_warps, cfg_splits = table or (HD256_CONFIG if hd >= 256 else (BLOCK_S, NUM_WARPS, 0))
    long = LONG_CONFIG.get(hd)
    if (long is not None and table is None and window >= LONG_WINDOW and block_s is None
            and num_warps is None and stages is None and capability is not None and capability >= (8, 0)):
        cfg_bs, cfg_warps, stages = long
    if block_s is None and cfg_bs * hd > VOLTA_TILE and capability is not None and capability < (8, 0):
        cfg_bs = VOLTA_TILE // hd  # a V100 block has 96 KB of shared memory: head dim 256 takes tiles of 64 (80 KB)
    stages = STAGES if stages is None else stages
    apart = (APART and stages > 1) if apart is None else apart
    return block_s or cfg_bs, num_warps or cfg_warps, cfg_splits, stages, apart


def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                     q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, *, n_heads: int, n_kv: int, hd: int, eps: float, window: int,
                     combine: str = "last", splits: int | None = None, block_s: int | None = None,
                     num_warps: int | None = None, gated: bool = False, zc: bool = False,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     stages: int | None = None,
                     apart: bool | None = None, permute: bool | None = None) -> torch.Tensor:
    """qkv [..., (n_heads + 2 n_kv) hd] (one row), cos/sin [1, hd] at pos, pos [1] (device int64) ->
    attention output [1, 1, n_heads hd] in qkv's dtype; K/V of pos written into the caches [1, kv, S, hd].
    ``combine``: "last" (the last program of a kv head combines, one kernel) or "kernel" (a second kernel);
    ``splits``: programs per kv head (default: splits_for); ``block_s``: positions per tile; defaults from
    the tuning table's ``attention`` (engine.tuning) or BLOCK_S, NUM_WARPS. Qwen3.5: ``gated`` (q rows
    [query | gate] per head, the output scaled by sigmoid(gate)), ``zc`` (zero-centred q/k norms) and a partial
    rotary (cos / sin narrower than the head: RoPE on its first cos.shape[-1] dimensions). An int8 cache comes
    with ``k_scale`` / ``v_scale`` [1, kv, S] float32 (engine.core.kvquant). ``stages``: tiles whose loads the
    loop keeps in flight (1: none; default STAGES); ``apart``: position
    pos attended after the tiles from registers instead of inside its tile (default: APART when stages > 1; the
    same scores, summed in another order); ``permute``: an int8 cache in fp16 widened by a byte permute (default
    I8_PERMUTE; exact either way). The launch's defaults: launch_config."""
    attn_k, comb_k = _kernels()
    cap = torch.cuda.get_device_capability(qkv.device) if qkv.device.type == "cuda" else None
    block_s, num_warps, cfg_splits, stages, apart = launch_config(
        hd, window, cap, block_s=block_s, num_warps=num_warps, stages=stages, apart=apart)
    splits = splits or cfg_splits or None
    g = n_heads // n_kv
    g_pad = max(16, 1 << (g - 1).bit_length())
    bs = block_s
    if splits is None:
        n_split, chunk = splits_for(window, n_kv, bs)
    else:
        tiles = -(-window // bs)
        chunk = -(-tiles // splits) * bs
        n_split = -(-window // chunk)
    dev = qkv.device
    out = torch.empty(n_heads * hd, dtype=qkv.dtype, device=dev)
    part_acc = torch.empty(n_kv * n_split * g_pad * hd, dtype=torch.float32, device=dev)
    part_ml = torch.empty(n_kv * n_split * 2 * g_pad, dtype=torch.float32, device=dev)
    one = combine == "last"
    count = _counter(k_cache, n_kv) if one else part_ml
    qk = q_norm is not None
    emu = _interpreting() and qkv.dtype == torch.bfloat16
    int8 = k_scale is not None
    permute = I8_PERMUTE if permute is None else permute
    attn_k[(n_kv, n_split)](
        qkv.reshape(-1), cos.reshape(-1), sin.reshape(-1), pos, q_norm if qk else qkv, k_norm if qk else qkv,
        k_cache, v_cache, out, part_acc, part_ml, count, float(eps), 1.0 / math.sqrt(hd),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        N_HEADS=n_heads, N_KV=n_kv, G=g, G_PAD=g_pad, HD=hd, CHUNK=chunk, BLOCK_S=bs, SPLITS=n_split,
        QK_NORM=qk, DOT_F32=qkv.dtype == torch.float32 or _interpreting(), ONE_KERNEL=one, EMU=emu,
        ROT=0 if cos.shape[-1] == hd else cos.shape[-1], GATED=gated, ZC=zc,
        ksc_ptr=k_scale if int8 else part_ml, vsc_ptr=v_scale if int8 else part_ml,
        stride_sh=k_scale.stride(1) if int8 else 0, INT8=int8, APART=apart,
        PERMUTE=bool(int8 and permute and qkv.dtype == torch.float16 and not _interpreting()), num_stages=stages,
        num_warps=num_warps)
    if not one:
        comb_k[(n_kv,)](part_acc, part_ml, out, qkv.reshape(-1), SPLITS=n_split, G=g, G_PAD=g_pad, HD=hd, EMU=emu,
                        GATED=gated, num_warps=4)
    return out.view(1, 1, n_heads * hd)


CPU_KERNELS = False  # the tests set it (with TRITON_INTERPRET=1): the fused blocks run their kernels on CPU


def runs_here(device: torch.device) -> bool:
    """The kernels run on CUDA devices (and on CPU tensors in the tests, under Triton's interpreter);
    elsewhere the fused blocks are the plain blocks (the CPU dry run of the variants bench)."""
    return device.type == "cuda" or (CPU_KERNELS and _interpreting())


def supported(hd: int, n_heads: int, n_kv: int) -> bool:
    """Shapes decode_attention handles: a power-of-two head dimension of 32 or more (Llama, Qwen: 64, 128)
    and whole groups of query heads per kv head. Others run the plain attention (with the Triton GEMVs)."""
    return hd >= 32 and hd & (hd - 1) == 0 and n_heads % n_kv == 0


def rotary_supported(rot: int, hd: int) -> bool:
    """A partial rotary the kernel's halves can hold: the rotary pairs inside the first half of the head."""
    return rot == hd or (rot % 2 == 0 and rot // 2 <= hd // 2)
