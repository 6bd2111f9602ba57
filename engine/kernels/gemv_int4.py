"""The decode step's one-row products on packed 4-bit weights (engine.core.quant.PackedLinear), in Triton.

y [N] = W [N, K] @ h [K] with W read as it is held: int32 words of eight 4-bit values along K, a 4-bit zero point
and a scale per (group, output):
    y[n] = sum over groups g of s[g, n] * sum over the group's words i of (sum_j q[n, 8i + j] h[8i + j] - z[g, n] hw[i])
so the bytes read are the packed weights, the zero points and the scales, nothing dequantised. Two kernels a call:
- ``int4_row_kernel`` makes the input row h once (K / SUB programs, SUB = min(BLOCK_K, group)): the same prologues as
  engine.kernels.gemv's bf16 GEMV (kernel choice "fused": residual add + RMSNorm with Hugging Face's rounding, or
  SiLU(gate) * up, or h = x; a desc_act input order read at perm[k]), written in "plane order" (per tile, the j-th
  input of every word together, scaled by 16^-j') as float32, with each word's sum of h (hw, for the zero points).
- ``int4_gemv_kernel``: each program owns BLOCK_N rows and a slice of K (split-K: ``split`` programs along K) and
  walks it a tile (one group's words at most) at a time: 16-byte loads of the words, then per plane j
  ``(word & 0xF << 4j) | 2^23`` as a float minus 2^23, i.e. q x 16^j exactly with no int-to-float conversion and no
  reshape (nibbles 5..7 from the word shifted by 12), times plane j of h; the group's scale and zero point once per
  word. ``stages`` 2 loads the next tile before this tile's arithmetic. With split-K the last program of a row block
  to finish adds the slices' sums in slice order (the same result whichever finishes last) and runs the epilogue:
  bias, rounding, and optionally the rows, tagged, to the peer's inbox (the TP2 exchange of
  engine.allreduce.epilogue, mode "send"). float32 sums in a fixed order: bit-identical ranks and graph replays.

For 16-bit activations the default is the fp16-pairs form (blocks[5] = FORM_PAIRS): the row kernel writes h as
fp16 pairs scaled per tile by a power of two (and the tile's factor), and the GEMV makes two nibbles per LOP3
(``& 0x000F000F | 0x64006400`` read as two fp16 is 1024 + q), takes 1024 + z off and multiplies by h in f16x2
arithmetic (inline PTX, an fp16x2 partial per word, float32 across words), ~2.7 SASS instructions per nibble against
~5.2 for the planes; the interpreter runs the same operands in float32 (``_pair_word``). float32 activations always take the planes form.

Options measured slower and deleted (the subnormal-pairs form, words in quads, two tiles ahead, a persistent
grid, Triton's cp.async pipeline): docs/engine-speed.md, history.

Prefill chunks do not come here: PackedLinear.linear dequantises the matrix for the chunk (``dequantise``, one
Triton kernel) and multiplies with cuBLAS.
"""

from __future__ import annotations

import functools
import os

import torch

from engine import tuning
from engine.core import quant
from engine.kernels import gemv

# Blocks per (prologue, N, K): the tuning table's ``int4`` (engine.tuning; bench: python -m engine.bench.int4
# --write-table), (BLOCK_N, BLOCK_K, num_warps, split, stages, form); _default_blocks for a matrix it does not list.
FORM_PLANES, FORM_PAIRS = 0, 1  # blocks[5]: the loop's form for 16-bit activations (float32 ones: planes)
DEFAULT_FORM = FORM_PAIRS
PAIR_DTYPES = (torch.bfloat16, torch.float16)
DEFAULT_STAGES = 2  # 2: the next tile's loads issued before this tile's arithmetic (registers); 1: not
TILE_ROWS = 32  # packed matrices on a GPU hold their words in tiles of this many rows (quant.PackedLinear.tiled); 0:
# in rows
TILE_DEVICES = ("cuda",)  # where loading tiles them (the CPU's products read rows)
PDL_ENV = "V100PLAN_ENGINE_INT4_PDL"  # "0": launch the GEMV after the row kernel as any kernel (no overlap)


def _default_blocks(n: int, k: int) -> tuple[int, ...]:
    """Blocks for a matrix the table does not list, by its height (a rule read off the 2026-12-04 sweep, within 6 %
    of the fastest on every matrix of it): four-warp programs of 64 rows; 1024 rows or fewer, K in 32 slices
    (enough programs for a short matrix), else in 8 (never more slices than tiles of 128 inputs). Tiles of 128
    inputs fetched one ahead, the pairs form."""
    split = 32 if n <= 1024 else 8
    return 64, 128, 4, max(1, min(split, k // 128)), 2, FORM_PAIRS


@functools.cache
def _kernels():
    # Triton resolves triton.language and the functions a kernel calls through the module's globals
    global tl, rnd, _normed, _norm_stats, _xs_send, _row, _q, _tile_loads, _tile_sum, _f16x2, _pair_word, _pair_loads
    global _pair_sum, _woff, _pdl_wait, _pdl_trigger, _ahead, _tile_exp, _fp16_pair, _int4_item
    import triton
    import triton.language as tl

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

    gemv._prologue_kernel()
    rnd, _normed, _norm_stats, _xs_send = gemv.rnd, gemv._normed, gemv._norm_stats, gemv._xs_send

    @triton.jit
    def _row(x_ptr, d_ptr, nw_ptr, perm_ptr, k0, cols0, K, rstd, dt: tl.constexpr, PROLOGUE: tl.constexpr,
             HAS_PERM: tl.constexpr, EMU: tl.constexpr, ZC: tl.constexpr):
        """The GEMV's input h at inputs k0 + cols0 (read at perm[k] with a desc_act order), float32, 0 past K."""
        cmask = (k0 + cols0) < K
        idx = k0 + cols0
        if HAS_PERM:
            idx = tl.load(perm_ptr + idx, mask=cmask, other=0)
        if PROLOGUE == 1:
            xv = tl.load(x_ptr + idx, mask=cmask, other=0.0).to(tl.float32)
            dv = tl.load(d_ptr + idx, mask=cmask, other=0.0).to(tl.float32)
            nw = tl.load(nw_ptr + idx, mask=cmask, other=0.0).to(tl.float32)
            r = rnd(xv + dv, dt, EMU).to(tl.float32)
            h = _normed(r, rstd, nw, dt, EMU, ZC).to(tl.float32)
        elif PROLOGUE == 2:
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
        if PROLOGUE == 1:  # statistics of x + delta (rounded), float32, natural order, the whole row
            rstd = _norm_stats(x_ptr, d_ptr, xo_ptr, K, c, eps, dt, EMU, STATS_BLOCK)
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
        (quant.PackedLinear.tiled) the tile kw // TW of the row's block, TW (quant.TILE_WORDS) words a row in
        it. A tile of SW <= TW words never crosses a held tile (SW divides TW, kw a multiple of SW)."""
        if TB == 0:
            return tl.multiple_of(kw, SW)
        return tl.multiple_of((kw // TW) * (TW * TB) + kw % TW, SW)

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
        if TB == 0:  # the words in rows
            wp = qw_ptr + rows[:, None].to(tl.int64) * KW + wcols[None, :]
        else:  # in tiles of TB rows x TW words (quant.PackedLinear.tiled)
            rb = (rows // TB).to(tl.int64) * (TB * KW) + (rows % TB) * TW
            wp = qw_ptr + rb[:, None] + wcols[None, :]
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
                    _xs_send(yd, pid, rows, rmask, N, xs_peer, xs_ser, xs_slot, xs_e, BLOCK_N, EPW)
        else:
            if HAS_BIAS:
                y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            yd = rnd(y, y_ptr.dtype.element_ty, EMU)
            tl.store(y_ptr + rows, yd, mask=rmask)
            if SEND:  # the same rows, tagged, into the peer's inbox (engine.kernels.gemv's epilogue)
                _xs_send(yd, pid, rows, rmask, N, xs_peer, xs_ser, xs_slot, xs_e, BLOCK_N, EPW)

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
        # in tiles of TB rows (quant.PackedLinear.tiled)
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

    return int4_gemv_kernel, dequant_kernel, int4_row_kernel


@functools.cache
def _triton_pdl() -> bool:
    """Whether this Triton launches with programmatic dependent launch and has grid dependency control."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_enabled(device: torch.device) -> bool:
    """The GEMV launched while its row kernel still runs (programmatic dependent launch): on compute capability
    9.0 and later (Hopper's grid dependency control), with a Triton that has it, not under the interpreter, and
    unless V100PLAN_ENGINE_INT4_PDL=0. The GEMV loads its first tile's words, then waits for the row kernel."""
    if device.type != "cuda" or gemv.interpreting() or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0) and _triton_pdl()


def held(w, device: torch.device):
    """A packed matrix as the GEMV on ``device`` reads it best: in tiles of TILE_ROWS rows on a GPU (words in
."""
    if TILE_ROWS and torch.device(device).type in TILE_DEVICES:
        return quant.tiled(w, TILE_ROWS)
    return w


def _tb(w) -> int:
    """The kernels' TB for a packed matrix: 0 in rows, else the tile's rows."""
    return w.tile_rows


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _counters(device: torch.device, blocks: int) -> torch.Tensor:
    """Split-K's per-row-block arrival counters on this device: zeros, and left at zero by every launch (the last
    program of a block resets its counter), so one buffer serves every matrix and every graph replay."""
    key = (device.type, device.index)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < blocks:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("int4 GEMV: split-K counters must exist before graph capture (run the step once)")
        have = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = have
    return have


_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


def row_input(prologue: int, x: torch.Tensor, w, sub: int, delta: torch.Tensor | None = None,
              norm_weight: torch.Tensor | None = None, eps: float = 0.0, x_out: torch.Tensor | None = None,
              zc: bool = False, pairs: bool = False, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMV's input (int4_row_kernel): h in plane order per ``sub`` inputs, float32, and each word's sum of
    h; NORM writes x + delta into x_out. ``pairs``: h as fp16 pairs (two in each float32's bits, sub / 2 per
    tile) and one factor per tile instead. ``pdl``: the next kernel (a GEMV launched with PDL) may start at once."""
    k = w.in_features
    nchunks = -(-k // sub)
    per = sub // (2 if pairs else 1)
    hp = torch.empty(nchunks * per, dtype=torch.float32, device=x.device)
    hw = torch.empty(nchunks * (1 if pairs else sub // 8), dtype=torch.float32, device=x.device)
    _kernels()[2][(nchunks,)](x, delta if delta is not None else x, norm_weight if norm_weight is not None else x,
                              w.perm if w.perm is not None else w.qweight, x_out if x_out is not None else hp, hp, hw,
                              k, float(eps), PROLOGUE=prologue, HAS_PERM=w.perm is not None, SUB=sub,
                              EMU=gemv.interpreting() and x.dtype == torch.bfloat16,
                              STATS_BLOCK=min(8192, _pow2_at_least(k)), ZC=zc, PAIRS=pairs, PDL=pdl,
                              num_warps=4)
    return hp, hw


def launch(prologue: int, x: torch.Tensor, w, b: torch.Tensor | None, out: torch.Tensor,
           delta: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
           x_out: torch.Tensor | None = None, blocks: tuple[int, ...] | None = None, send=None,
           zc: bool = False) -> torch.Tensor:
    """out [N] = W @ h (+ b), h made from x by the prologue (engine.kernels.gemv's PROLOGUE_PLAIN / NORM / SILU; x: [K],
    or [2K] = [gate | up] for SiLU); NORM writes x + delta into x_out [K]. ``send``: as gemv.launch_prologue's.
    ``blocks``: (BLOCK_N, BLOCK_K, num_warps[, split[, stages[, form]]]): split = programs along K
    (split-K, default 1), stages = the depth of the loop's load pipeline (DEFAULT_STAGES), form = FORM_PAIRS (fp16
    pairs, 16-bit activations only) or FORM_PLANES (float32 planes; float32 activations always), DEFAULT_FORM."""
    n, k = w.shape
    name = gemv.PROLOGUE_NAMES[prologue]
    cfg = tuple(blocks or tuning.active().int4.get((name, n, k)) or _default_blocks(n, k))
    bn, bk, warps = cfg[:3]
    split = cfg[3] if len(cfg) > 3 else 1
    stages = cfg[4] if len(cfg) > 4 else DEFAULT_STAGES
    form = cfg[5] if len(cfg) > 5 else DEFAULT_FORM
    if stages not in (1, 2) or form not in (FORM_PLANES, FORM_PAIRS):
        raise ValueError(f"int4 GEMV: blocks {cfg}: stages must be 1 or 2 and form 0 (planes) or 1 (pairs)")
    pairs = x.dtype in PAIR_DTYPES and form == FORM_PAIRS
    if gemv.interpreting() and blocks is None:
        bn = 32  # the interpreter runs programs one after another: fewer, wider ones
    bk = min(bk, _pow2_at_least(k))
    if w.tile_rows:
        bk = min(bk, 8 * quant.TILE_WORDS)  # a tile inside one held tile
    gs = w.group_size if w.group_size < k else -(-k // bk) * bk  # one group over all inputs: whole tiles of it
    sub = min(bk, gs)
    if stages >= 2:
        bk = sub  # the prefetching loops take one group's tile at a time
    if gs % sub or bk % sub or sub % 8 or sub & (sub - 1):
        raise ValueError(f"int4 GEMV: BLOCK_K {bk} and group size {gs} must nest (powers of two, at least 8)")
    tiles = -(-k // bk)
    split = max(1, min(split, tiles))
    ks = -(-tiles // split) * bk  # inputs per slice: whole tiles (so whole groups, or whole tiles of one group)
    split = -(-k // ks)
    grid_n = -(-n // bn)
    part = counters = out
    if split > 1:
        part = torch.empty(split * n, dtype=torch.float32, device=out.device)
        counters = _counters(out.device, grid_n)
    pdl = pdl_enabled(out.device)
    hp, hw = row_input(prologue, x, w, sub, delta, norm_weight, eps, x_out if x_out is not None else out, zc, pairs,
                       pdl)
    emu = gemv.interpreting() and x.dtype == torch.bfloat16
    peer, ser, slot, e = gemv._xs_args(send, out)
    _kernels()[0][(grid_n, split)](
        w.qweight, w.qzeros, w.scales, hp, hw, b if b is not None else out, out, part, counters, n, k, k // 8, ks // 8,
        peer, ser, slot, e, HAS_BIAS=b is not None, BLOCK_N=bn, BLOCK_K=bk, GS=gs, ZOFF=w.zero_offset, EMU=emu,
        SEND=send is not None, EPW=gemv._epw(out.dtype), SPLIT=split, EVEN_K=k % bk == 0 and ks % bk == 0,
        STAGES=stages, PAIRS=pairs, ASM=not gemv.interpreting(), EVEN_N=n % bn == 0, TB=_tb(w),
        TW=quant.TILE_WORDS, PDL=pdl, num_warps=warps, **({"launch_pdl": True} if pdl else {}))
    return out


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (one row) @ W^T + b."""
    out = torch.empty(w.out_features, dtype=x.dtype, device=x.device)
    launch(gemv.PROLOGUE_PLAIN, x.reshape(-1).contiguous(), w, b, out)
    return out.view(*x.shape[:-1], w.out_features)


def linear_norm(x: torch.Tensor, delta, norm_weight: torch.Tensor, eps: float, w, b: torch.Tensor | None = None,
                zc: bool = False):
    """gemv.linear_norm for a packed weight: (RMSNorm(x + delta) @ W^T + b, x + delta), one kernel. ``delta`` must
    be a tensor: the receiving exchange (mode "gemv") is not offered for packed weights. ``zc``: the zero-centred
    norm (Qwen3.5)."""
    if not isinstance(delta, torch.Tensor):
        raise ValueError("packed weights: the exchange is received by its own kernel (exchange mode 'send' or "
                         "'kernel', not 'gemv')")
    k = w.in_features
    out = torch.empty(w.out_features, dtype=x.dtype, device=x.device)
    x_out = torch.empty(k, dtype=x.dtype, device=x.device)
    launch(gemv.PROLOGUE_NORM, x.reshape(-1).contiguous(), w, b, out, delta.reshape(-1).contiguous(), norm_weight,
           eps, x_out, zc=zc)
    return out.view(*x.shape[:-1], w.out_features), x_out.view(x.shape)


def linear_silu(gu: torch.Tensor, w, b: torch.Tensor | None = None, send=None):
    """gemv.linear_silu for a packed weight."""
    out = torch.empty(w.out_features, dtype=gu.dtype, device=gu.device)
    launch(gemv.PROLOGUE_SILU, gu.reshape(-1).contiguous(), w, b, out, send=send)
    return gemv._sent(out.view(*gu.shape[:-1], w.out_features), send)


def linear_send(x: torch.Tensor, w, b: torch.Tensor | None, send=None):
    """gemv.linear_send for a packed weight."""
    out = torch.empty(w.out_features, dtype=x.dtype, device=x.device)
    launch(gemv.PROLOGUE_PLAIN, x.reshape(-1).contiguous(), w, b, out, send=send)
    return gemv._sent(out.view(*x.shape[:-1], w.out_features), send)


def dequantise(w, dtype: torch.dtype, blocks: tuple[int, int] = (32, 128)) -> torch.Tensor:
    """W [N, K] in the held input order, for a prefill chunk's GEMM (made per call, freed after it)."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=dtype, device=w.device)
    gs = w.group_size if w.group_size < k else _pow2_at_least(k)
    _kernels()[1][(-(-n // blocks[0]), -(-k // blocks[1]))](w.qweight, w.qzeros, w.scales, out, n, k, GS=gs,
                                                           ZOFF=w.zero_offset, BLOCK_N=blocks[0], BLOCK_K=blocks[1],
                                                           TB=_tb(w), TW=quant.TILE_WORDS)
    return out
