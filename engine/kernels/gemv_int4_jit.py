"""The int4 GEMV's kernels in Triton (engine.kernels.gemv_int4 launches them and says what they compute): the row
kernel that makes the input h once (``int4_row_kernel``), the GEMV on the packed words (``int4_gemv_kernel``, planes
or fp16 pairs, split-K, one tile ahead, programmatic dependent launch) and the prefill's dequantise
(``dequant_kernel``). The batched decode step's GEMV on 1..16 rows is engine.kernels.gemv_int4_rows_jit's."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.exchange_jit import xs_send
from engine.kernels.prologue_jit import PRO_NORM, PRO_SILU, norm_stats
from engine.kernels.rounding_jit import normed, rnd

try:  # grid dependency control (programmatic dependent launch, sm_90+): Triton 3.3 and later
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_trigger
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except ImportError:  # only reached with PDL off (pdl_enabled), where the calls are compiled out
    _gdc_trigger = _gdc_wait = None


@triton.jit
def _pdl_wait():
    """Wait until the kernel before this one (the row kernel) has finished and its writes are visible."""
    _gdc_wait()


@triton.jit
def _pdl_trigger():
    """Let the next kernel (the GEMV) be launched now, while this one still runs."""
    _gdc_trigger()


@triton.jit
def _row(x_ptr, d_ptr, nw_ptr, perm_ptr, k0, cols0, K, rstd, dt: tl.constexpr, PROLOGUE: tl.constexpr,
         HAS_PERM: tl.constexpr, EMU: tl.constexpr, ZC: tl.constexpr):
    """The GEMV's input h at inputs k0 + cols0 (read at perm[k] with a desc_act order), float32, 0 past K."""
    cmask = (k0 + cols0) < K
    idx = k0 + cols0
    if HAS_PERM:
        idx = tl.load(perm_ptr + idx, mask=cmask, other=0)
    if PROLOGUE == PRO_NORM:
        xv = tl.load(x_ptr + idx, mask=cmask, other=0.0).to(tl.float32)
        dv = tl.load(d_ptr + idx, mask=cmask, other=0.0).to(tl.float32)
        nw = tl.load(nw_ptr + idx, mask=cmask, other=0.0).to(tl.float32)
        r = rnd(xv + dv, dt, EMU).to(tl.float32)
        h = normed(r, rstd, nw, dt, EMU, ZC).to(tl.float32)
    elif PROLOGUE == PRO_SILU:
        g = tl.load(x_ptr + idx, mask=cmask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + idx, mask=cmask, other=0.0).to(tl.float32)
        sg = rnd(g / (1.0 + tl.exp(-g)), dt, EMU).to(tl.float32)
        h = rnd(sg * u, dt, EMU).to(tl.float32)
    else:
        h = tl.load(x_ptr + idx, mask=cmask, other=0.0).to(tl.float32)
    return tl.where(cmask, h, 0.0)


@triton.jit
def _ahead(kn, kwend, SW: tl.constexpr, UNMASKED: tl.constexpr):
    """The word a prefetch of a tile ahead loads: kn, or, where the loads carry no masks (UNMASKED), the
    slice's last tile again once kn passes it (loaded, never summed)."""
    if UNMASKED:
        return tl.multiple_of(tl.minimum(kn, kwend - SW), SW)
    return kn


@triton.jit
def _tile_exp(hl, hh):
    """e = floor(log2 max |h|) over a tile's two halves (0 for a tile of zeros), clipped to +-100."""
    m = tl.maximum(tl.max(tl.abs(hl), axis=0), tl.max(tl.abs(hh), axis=0))
    e = tl.where(m > 0.0, tl.floor(tl.log2(m)), 0.0)
    return tl.minimum(tl.maximum(e, -100.0), 100.0)


@triton.jit
def _fp16_pair(lo, hi):
    """Two float32 values as the fp16 halves of one int32 (low, high)."""
    bl = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return bl | (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def int4_row_kernel(x_ptr, d_ptr, nw_ptr, perm_ptr, xo_ptr, hp_ptr, hw_ptr, K, eps, PROLOGUE: tl.constexpr,
                    HAS_PERM: tl.constexpr, SUB: tl.constexpr, EMU: tl.constexpr, STATS_BLOCK: tl.constexpr,
                    ZC: tl.constexpr = False, PAIRS: tl.constexpr = False, PDL: tl.constexpr = False):
    """The GEMV's input row h for inputs [c SUB, (c + 1) SUB), c = this program, in plane order: hp[c SUB +
    j SUB / 8 + i] = h[c SUB + 8 i + j] x 16^-j' (j' = j for nibbles 0..4, j - 3 for 5..7: the place the
    GEMV leaves nibble j of word i in), float32; hw[c SUB / 8 + i] = the sum of word i's eight h (the zero
    points' term). PDL: the GEMV that reads h may be launched at once (it waits for this kernel itself)."""
    if PDL:
        _pdl_trigger()
    c = tl.program_id(0)
    dt = x_ptr.dtype.element_ty
    SW: tl.constexpr = SUB // 8
    rstd = 0.0
    if PROLOGUE == PRO_NORM:  # statistics of x + delta (rounded), float32, natural order, the whole row
        rstd = norm_stats(x_ptr, d_ptr, xo_ptr, K, c, eps, dt, EMU, STATS_BLOCK)
    if PAIRS:
        # pair plane p of word i: (h[8 i + p], h[8 i + p + 4]) as two fp16 in one int32 (low, high), scaled by
        # a power of two from e = floor(log2 max |h|) over the tile; a 16-bit h is exact in fp16 (bf16's
        # 8-bit mantissa fits in 11) far below the tile's largest
        dst2 = tl.arange(0, SUB // 2)
        src2 = 8 * (dst2 % SW) + dst2 // SW
        hl = _row(x_ptr, d_ptr, nw_ptr, perm_ptr, c * SUB, src2, K, rstd, dt, PROLOGUE, HAS_PERM, EMU, ZC)
        hh = _row(x_ptr, d_ptr, nw_ptr, perm_ptr, c * SUB, src2 + 4, K, rstd, dt, PROLOGUE, HAS_PERM, EMU, ZC)
        e = _tile_exp(hl, hh)
        # times 2^(5 - e), the largest |h| in [32, 64), so no product or partial sum of the GEMV's fp16
        # arithmetic overflows (|q - z| <= 16). hw[c] = 2^(e - 5).
        up = tl.exp2(5.0 - e)
        tl.store(hp_ptr.to(tl.pointer_type(tl.int32)) + c * (SUB // 2) + dst2, _fp16_pair(hl * up, hh * up))
        tl.store(hw_ptr + c, tl.exp2(e - 5.0))
    else:
        dst = tl.arange(0, SUB)
        j = dst // SW
        src = 8 * (dst % SW) + j
        h = _row(x_ptr, d_ptr, nw_ptr, perm_ptr, c * SUB, src, K, rstd, dt, PROLOGUE, HAS_PERM, EMU, ZC)
        tl.store(hp_ptr + c * SUB + dst, h * tl.exp2(-4.0 * (j - tl.where(j < 5, 0, 3)).to(tl.float32)))
        w8 = tl.arange(0, SW)[:, None] * 8 + tl.arange(0, 8)[None, :]  # [SW, 8]: word i's inputs, natural order
        hn = _row(x_ptr, d_ptr, nw_ptr, perm_ptr, c * SUB, w8, K, rstd, dt, PROLOGUE, HAS_PERM, EMU, ZC)
        tl.store(hw_ptr + c * SW + tl.arange(0, SW), tl.sum(hn, axis=1))


@triton.jit
def _q(w, J: tl.constexpr):
    """Nibble J of each word left in place (q x 16^J) and ORed into the mantissa of 2^23: minus 2^23 it is
    exact, with no int-to-float conversion (a quarter-rate instruction)."""
    return ((w & (0xF << (4 * J))) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _woff(kw, TB: tl.constexpr, TW: tl.constexpr, SW: tl.constexpr):
    """Where word kw of a row sits past the row's base pointer: kw in the row layout; in tiles of TB rows
    (PackedLinear.tiled) the tile kw // TW of the row's block, TW (int4_pack.TILE_WORDS) words a row in
    it. A tile of SW <= TW words never crosses a held tile (SW divides TW, kw a multiple of SW)."""
    if TB == 0:
        return tl.multiple_of(kw, SW)
    return tl.multiple_of((kw // TW) * (TW * TB) + kw % TW, SW)


@triton.jit
def _row_words(qw_ptr, rows, wcols, KW, TB: tl.constexpr, TW: tl.constexpr):
    """Pointers to words wcols of each of ``rows`` (kw 0; _woff moves along K): the words in rows (TB 0), or in tiles
    of TB rows x TW words (PackedLinear.tiled)."""
    if TB == 0:
        return qw_ptr + rows[:, None].to(tl.int64) * KW + wcols[None, :]
    rb = (rows // TB).to(tl.int64) * (TB * KW) + (rows % TB) * TW
    return qw_ptr + rb[:, None] + wcols[None, :]


@triton.jit
def _tile_loads(wp, hp_ptr, hw_ptr, s_ptr, qz_ptr, kw, kwend, rows, rmask, wcols, zshift, N, KW,
                SW: tl.constexpr, GS: tl.constexpr, ZOFF: tl.constexpr, EVEN_K: tl.constexpr,
                TB: tl.constexpr = 0, TW: tl.constexpr = 16):
    """What one tile (words kw .. kw + SW of each row, inside one group) reads: the words, the group's scale
    and zero point per row, the eight planes of h and each word's sum of h (nothing past kwend)."""
    ok = (rows * 0 + kw) < kwend
    okc = (wcols * 0 + kw) < kwend
    wo = _woff(kw, TB, TW, SW)
    if EVEN_K:  # no mask along K: 16-byte loads
        words = tl.load(wp + wo, mask=(rmask & ok)[:, None], other=0, eviction_policy="evict_first")
    else:
        words = tl.load(wp + wo, mask=(rmask & ok)[:, None] & ((kw + wcols) < KW)[None, :], other=0,
                        eviction_policy="evict_first")  # [BLOCK_N, SW] int32
    grp = (kw * 8) // GS
    sc = tl.load(s_ptr + grp * N + rows, mask=rmask & ok, other=0.0).to(tl.float32)
    zw = tl.load(qz_ptr + grp * (N // 8) + rows // 8, mask=rmask & ok, other=0)
    z = ((zw >> zshift) & 0xF).to(tl.float32) + ZOFF
    hb = hp_ptr + kw * 8 + wcols
    hw = tl.load(hw_ptr + kw + wcols, mask=okc, other=0.0)  # [SW]: the sum of each word's h
    return (words, sc, z, hw, tl.load(hb, mask=okc, other=0.0), tl.load(hb + SW, mask=okc, other=0.0),
            tl.load(hb + 2 * SW, mask=okc, other=0.0), tl.load(hb + 3 * SW, mask=okc, other=0.0),
            tl.load(hb + 4 * SW, mask=okc, other=0.0), tl.load(hb + 5 * SW, mask=okc, other=0.0),
            tl.load(hb + 6 * SW, mask=okc, other=0.0), tl.load(hb + 7 * SW, mask=okc, other=0.0))


@triton.jit
def _tile_sum(words, sc, z, hw, h0, h1, h2, h3, h4, h5, h6, h7):
    """[BLOCK_N, SW]: per word, s (sum over its eight inputs of q h - z sum of h). Plane j of h comes scaled
    by 16^-j (int4_row_kernel), nibbles 5..7 from the word shifted by 12 (below the float's exponent)."""
    hi = words >> 12
    part = _q(words, 0) * h0[None, :]  # a chain of multiply-adds, plane by plane
    part += _q(words, 1) * h1[None, :]
    part += _q(words, 2) * h2[None, :]
    part += _q(words, 3) * h3[None, :]
    part += _q(words, 4) * h4[None, :]
    part += _q(hi, 2) * h5[None, :]
    part += _q(hi, 3) * h6[None, :]
    part += _q(hi, 4) * h7[None, :]
    return sc[:, None] * (part - z[:, None] * hw[None, :])


@triton.jit
def _f16x2(x):
    """The two fp16 halves of int32 words (low, high) as float32."""
    lo = ((x << 16) >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _pair_word(w, h0, h1, h2, h3, zlo, zhi, ASM: tl.constexpr):
    """float32 per word: the sum over its eight nibbles q of (q - z) h, the nibbles made two at a time:
    ``(w >> 8m) & 0x000F000F | 0x64006400`` read as two fp16 is (1024 + q, 1024 + q') for nibbles (2m, 2m + 4)
    and ``& 0x00F000F0`` gives (1024 + 16 q, ...) for nibbles (2m + 1, 2m + 5): one LOP3 per two values.
    zlo = (1024 + z) twice and zhi = -(64 + z) twice (fp16 bits) take the zero point off exactly (|q - z| <=
    16), and h comes in the same pairs (int4_row_kernel, PAIRS). ASM: PTX with f16x2 arithmetic, the word's
    eight products summed in an fp16x2 partial then widened (one word at most, |products| <= 1024: a few fp16
    roundings per word, summed in float32); otherwise the same operands in float32 arithmetic (the
    interpreter cannot run inline assembly)."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 %qa, %qb, %qc, %qd, %qt, %qs, %qacc;
            .reg .f16 %ql, %qh;
            lop3.b32 %qa, $1, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 %qb, $1, 0x00F000F0, 0x64006400, 0xEA;
            shr.u32 %qt, $1, 8;
            lop3.b32 %qc, %qt, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 %qd, %qt, 0x00F000F0, 0x64006400, 0xEA;
            mov.b32 %qs, 0x2C002C00;
            sub.f16x2 %qa, %qa, $6;
            fma.rn.f16x2 %qb, %qb, %qs, $7;
            sub.f16x2 %qc, %qc, $6;
            fma.rn.f16x2 %qd, %qd, %qs, $7;
            mul.f16x2 %qacc, %qa, $2;
            fma.rn.f16x2 %qacc, %qb, $3, %qacc;
            fma.rn.f16x2 %qacc, %qc, $4, %qacc;
            fma.rn.f16x2 %qacc, %qd, $5, %qacc;
            mov.b32 {%ql, %qh}, %qacc;
            add.rn.f16 %ql, %ql, %qh;
            cvt.f32.f16 $0, %ql;
            }""",
            constraints="=f,r,r,r,r,r,r,r", args=[w, h0, h1, h2, h3, zlo, zhi], dtype=tl.float32,
            is_pure=True, pack=1)
    else:
        zl, _ = _f16x2(zlo)
        zh, _ = _f16x2(zhi)
        t = w >> 8
        a0, a1 = _f16x2((w & 0x000F000F) | 0x64006400)
        b0, b1 = _f16x2((w & 0x00F000F0) | 0x64006400)
        c0, c1 = _f16x2((t & 0x000F000F) | 0x64006400)
        d0, d1 = _f16x2((t & 0x00F000F0) | 0x64006400)
        g0, g1 = _f16x2(h0)
        g2, g3 = _f16x2(h1)
        g4, g5 = _f16x2(h2)
        g6, g7 = _f16x2(h3)
        s = (a0 - zl) * g0 + (a1 - zl) * g1 + (b0 * 0.0625 + zh) * g2 + (b1 * 0.0625 + zh) * g3
        return s + (c0 - zl) * g4 + (c1 - zl) * g5 + (d0 * 0.0625 + zh) * g6 + (d1 * 0.0625 + zh) * g7


@triton.jit
def _pair_loads(wp, hq_ptr, hf_ptr, s_ptr, qz_ptr, kw, kwend, rows, rmask, wcols, zshift, N, KW,
                SW: tl.constexpr, GS: tl.constexpr, ZOFF: tl.constexpr, EVEN_K: tl.constexpr,
                EVEN_N: tl.constexpr, TB: tl.constexpr = 0, TW: tl.constexpr = 16):
    """What one tile reads in the pairs form: the words, the group's scale times the tile's factor of h and
    the zero point as fp16 pairs per row ([BLOCK_N, 1], in the words' layout), and h's four pair planes
    (int32 words of two fp16). EVEN_K and EVEN_N: every tile is inside the matrix (the caller keeps kw below
    kwend), so nothing is masked."""
    r2 = rows[:, None]
    grp = (kw * 8) // GS
    wo = _woff(kw, TB, TW, SW)
    if EVEN_K and EVEN_N:
        words = tl.load(wp + wo, eviction_policy="evict_first")
        f = tl.load(hf_ptr + kw // SW)
        sc = tl.load(s_ptr + grp * N + r2).to(tl.float32) * f
        zw = tl.load(qz_ptr + grp * (N // 8) + r2 // 8)
        hb = hq_ptr + kw * 4 + wcols[None, :]
        h0, h1 = tl.load(hb), tl.load(hb + SW)
        h2, h3 = tl.load(hb + 2 * SW), tl.load(hb + 3 * SW)
    else:
        ok = (r2 * 0 + kw) < kwend
        m2 = rmask[:, None] & ok
        okc = (wcols[None, :] * 0 + kw) < kwend
        if EVEN_K:
            words = tl.load(wp + wo, mask=m2, other=0, eviction_policy="evict_first")
        else:
            words = tl.load(wp + wo, mask=m2 & ((kw + wcols) < KW)[None, :], other=0,
                            eviction_policy="evict_first")
        f = tl.load(hf_ptr + kw // SW + r2 * 0, mask=m2, other=0.0)
        sc = tl.load(s_ptr + grp * N + r2, mask=m2, other=0.0).to(tl.float32) * f
        zw = tl.load(qz_ptr + grp * (N // 8) + r2 // 8, mask=m2, other=0)
        hb = hq_ptr + kw * 4 + wcols[None, :]
        h0, h1 = tl.load(hb, mask=okc, other=0), tl.load(hb + SW, mask=okc, other=0)
        h2, h3 = tl.load(hb + 2 * SW, mask=okc, other=0), tl.load(hb + 3 * SW, mask=okc, other=0)
    z = ((zw >> zshift[:, None]) & 0xF) + ZOFF
    zlo = 0x64006400 + z * 0x00010001  # (1024 + z) as two fp16
    zhi = -738143232 + (z * 16) * 0x00010001  # 0xD400D400 + 16 z per half: -(64 + z) as two fp16
    return words, sc, zlo, zhi, h0, h1, h2, h3


@triton.jit
def _pair_sum(words, sc, zlo, zhi, h0, h1, h2, h3, ASM: tl.constexpr):
    return sc * _pair_word(words, h0, h1, h2, h3, zlo, zhi, ASM)


@triton.jit
def _int4_item(pid, pk, qw_ptr, qz_ptr, s_ptr, hp_ptr, hw_ptr, b_ptr, y_ptr, part_ptr, count_ptr, N, K, KW, KS,
               xs_peer, xs_ser, xs_slot, xs_e, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, GS: tl.constexpr, ZOFF: tl.constexpr, EMU: tl.constexpr,
               SEND: tl.constexpr, EPW: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
               STAGES: tl.constexpr, PAIRS: tl.constexpr, ASM: tl.constexpr, EVEN_N: tl.constexpr,
               TB: tl.constexpr, TW: tl.constexpr, PDL: tl.constexpr):
    """One work item of the GEMV: row block pid (BLOCK_N rows), slice pk of K (split-K: words [pk KS, (pk + 1)
    KS) of each row). PDL: launched while the row kernel still runs (programmatic dependent launch):
    everything before _pdl_wait reads only what no kernel still running writes (words, scales, zero points)."""
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    SUB: tl.constexpr = BLOCK_K if BLOCK_K < GS else GS  # inputs of one sub-tile: inside one group
    NSUB: tl.constexpr = BLOCK_K // SUB
    SW: tl.constexpr = SUB // 8  # words per row per sub-tile
    wcols = tl.arange(0, SW)
    zshift = (rows % 8) * 4
    wp = _row_words(qw_ptr, rows, wcols, KW, TB, TW)
    acc = tl.zeros((BLOCK_N, SW), dtype=tl.float32)
    # the loop counts in words (KS: words per slice) so that the compiler sees 16-byte-aligned word offsets
    kwbeg = pk * KS
    kwend = tl.minimum(kwbeg + KS, KW)
    if PAIRS:
        # 16-bit activations: h in fp16 pairs, two nibbles per instruction (_pair_word); hp: the pairs as
        # int32, hw: one factor per tile
        hq_ptr = hp_ptr.to(tl.pointer_type(tl.int32))
        if STAGES == 2:
            if PDL:  # the first tile's words are on their way while the row kernel finishes h
                if EVEN_K and EVEN_N:  # every slice holds a tile (launch): 16-byte loads, no mask
                    w0 = tl.load(wp + _woff(kwbeg, TB, TW, SW), eviction_policy="evict_first")
                else:
                    w0 = tl.load(wp + _woff(kwbeg, TB, TW, SW), mask=rmask[:, None] & (kwbeg < kwend), other=0,
                                 eviction_policy="evict_first")
                _pdl_wait()
            t = _pair_loads(wp, hq_ptr, hw_ptr, s_ptr, qz_ptr, kwbeg, kwend, rows, rmask, wcols, zshift, N, KW,
                            SW, GS, ZOFF, EVEN_K, EVEN_N, TB, TW)
            if PDL:
                t = (w0,) + t[1:]
            for kw in range(kwbeg, kwend, SW):
                kn = _ahead(kw + SW, kwend, SW, EVEN_K and EVEN_N)
                nxt = _pair_loads(wp, hq_ptr, hw_ptr, s_ptr, qz_ptr, kn, kwend, rows, rmask, wcols, zshift,
                                  N, KW, SW, GS, ZOFF, EVEN_K, EVEN_N, TB, TW)
                acc += _pair_sum(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], ASM)
                t = nxt
        else:
            if PDL:
                _pdl_wait()
            for kw0 in range(kwbeg, kwend, BLOCK_K // 8):
                for s in tl.static_range(NSUB):
                    t = _pair_loads(wp, hq_ptr, hw_ptr, s_ptr, qz_ptr, kw0 + s * SW, kwend, rows, rmask, wcols,
                                    zshift, N, KW, SW, GS, ZOFF, EVEN_K, EVEN_N, TB, TW)
                    acc += _pair_sum(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], ASM)
    elif STAGES == 2:
        # one tile ahead in registers: the next tile's loads are issued before this tile's arithmetic, so
        # the loop does not wait for memory once per tile (the compiler otherwise issues some loads late,
        # each a round trip); one sub-tile per tile (BLOCK_K <= GS)
        if PDL:
            _pdl_wait()
        t = _tile_loads(wp, hp_ptr, hw_ptr, s_ptr, qz_ptr, kwbeg, kwend, rows, rmask, wcols, zshift, N, KW, SW,
                        GS, ZOFF, EVEN_K, TB, TW)
        for kw in range(kwbeg, kwend, SW):
            nxt = _tile_loads(wp, hp_ptr, hw_ptr, s_ptr, qz_ptr, kw + SW, kwend, rows, rmask, wcols, zshift, N,
                              KW, SW, GS, ZOFF, EVEN_K, TB, TW)
            acc += _tile_sum(*t)
            t = nxt
    else:
        if PDL:
            _pdl_wait()
        for kw0 in range(kwbeg, kwend, BLOCK_K // 8):
            for s in tl.static_range(NSUB):
                acc += _tile_sum(*_tile_loads(wp, hp_ptr, hw_ptr, s_ptr, qz_ptr, kw0 + s * SW, kwend, rows, rmask,
                                              wcols, zshift, N, KW, SW, GS, ZOFF, EVEN_K, TB, TW))
    y = tl.sum(acc, axis=1)
    if SPLIT > 1:
        # every slice's sums to part [SPLIT, N]; the last program of this row block to finish adds them in
        # slice order (the same sum whichever finishes last) and resets the block's counter for the next call
        tl.store(part_ptr + pk * N + rows, y, mask=rmask)
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:
            y = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for j in range(0, SPLIT):
                y += tl.load(part_ptr + j * N + rows, mask=rmask, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + pid, 0)
            if HAS_BIAS:
                y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            yd = rnd(y, y_ptr.dtype.element_ty, EMU)
            tl.store(y_ptr + rows, yd, mask=rmask)
            if SEND:
                xs_send(yd, pid, rows, rmask, N, xs_peer, xs_ser, xs_slot, xs_e, BLOCK_N, EPW)
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        yd = rnd(y, y_ptr.dtype.element_ty, EMU)
        tl.store(y_ptr + rows, yd, mask=rmask)
        if SEND:  # the same rows, tagged, into the peer's inbox (engine.kernels.gemv_jit's epilogue)
            xs_send(yd, pid, rows, rmask, N, xs_peer, xs_ser, xs_slot, xs_e, BLOCK_N, EPW)


@triton.jit
def int4_gemv_kernel(qw_ptr, qz_ptr, s_ptr, hp_ptr, hw_ptr, b_ptr, y_ptr, part_ptr, count_ptr, N, K, KW, KS,
                     xs_peer, xs_ser, xs_slot, xs_e, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GS: tl.constexpr, ZOFF: tl.constexpr, EMU: tl.constexpr,
                     SEND: tl.constexpr, EPW: tl.constexpr, SPLIT: tl.constexpr = 1,
                     EVEN_K: tl.constexpr = False, STAGES: tl.constexpr = 1, PAIRS: tl.constexpr = False,
                     ASM: tl.constexpr = True, EVEN_N: tl.constexpr = False, TB: tl.constexpr = 0,
                     TW: tl.constexpr = 16, PDL: tl.constexpr = False):
    """The GEMV: _int4_item for row block program_id(0), slice program_id(1) of K."""
    _int4_item(tl.program_id(0), tl.program_id(1), qw_ptr, qz_ptr, s_ptr, hp_ptr, hw_ptr, b_ptr, y_ptr,
               part_ptr, count_ptr, N, K, KW, KS, xs_peer, xs_ser, xs_slot, xs_e, HAS_BIAS, BLOCK_N, BLOCK_K,
               GS, ZOFF, EMU, SEND, EPW, SPLIT, EVEN_K, STAGES, PAIRS, ASM, EVEN_N, TB, TW, PDL)


@triton.jit
def dequant_kernel(qw_ptr, qz_ptr, s_ptr, out_ptr, N, K, GS: tl.constexpr, ZOFF: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TB: tl.constexpr = 0,
                   TW: tl.constexpr = 16):
    # out [N, K] = s * (q - z) in the held input order, rounded once to out's dtype; TB > 0: the words held
    # in tiles of TB rows (PackedLinear.tiled)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (rows < N)[:, None] & (cols < K)[None, :]
    wi = cols // 8
    if TB == 0:
        at = rows[:, None].to(tl.int64) * (K // 8) + wi[None, :]
    else:
        at = ((rows // TB).to(tl.int64) * (TB * (K // 8)) + (rows % TB) * TW)[:, None] + (
            (wi // TW) * (TW * TB) + wi % TW)[None, :]
    words = tl.load(qw_ptr + at, mask=m, other=0)
    q = ((words >> ((cols % 8) * 4)[None, :]) & 0xF).to(tl.float32)
    g = cols // GS
    sc = tl.load(s_ptr + g[None, :] * N + rows[:, None], mask=m, other=0.0).to(tl.float32)
    zw = tl.load(qz_ptr + g[None, :] * (N // 8) + (rows // 8)[:, None], mask=m, other=0)
    z = ((zw >> ((rows % 8) * 4)[:, None]) & 0xF).to(tl.float32) + ZOFF
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], (sc * (q - z)).to(out_ptr.dtype.element_ty),
             mask=m)
