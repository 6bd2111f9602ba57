"""The batched decode step's int4 GEMV in Triton (``int4_rows_kernel``: M = 1..16 rows of x through one packed
matrix, each weight word read once; engine.kernels.gemv_int4.launch_rows launches it and says what it computes)."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.gemv_int4_jit import _row_words, _woff
from engine.kernels.rounding_jit import rnd


@triton.jit
def _rows_tile(wp, s_ptr, qz_ptr, kw, rows, rmask, zshift, N, SW: tl.constexpr, GS: tl.constexpr,
               ZOFF: tl.constexpr, EVEN: tl.constexpr, KMASK, TB: tl.constexpr, TW: tl.constexpr):
    """One tile of the batched GEMV: the words [BLOCK_N, SW] (kw .. kw + SW of each row, inside one group), the
    group's scale per row (float32) and zero point per row (int32, ZOFF added). EVEN: no row or K mask;
    else KMASK [SW] masks words past the matrix along K."""
    wo = _woff(kw, TB, TW, SW)
    grp = (kw * 8) // GS
    if EVEN:
        words = tl.load(wp + wo, eviction_policy="evict_first")
        sc = tl.load(s_ptr + grp * N + rows).to(tl.float32)
        zw = tl.load(qz_ptr + grp * (N // 8) + rows // 8)
    else:
        words = tl.load(wp + wo, mask=rmask[:, None] & KMASK[None, :], other=0, eviction_policy="evict_first")
        sc = tl.load(s_ptr + grp * N + rows, mask=rmask, other=0.0).to(tl.float32)
        zw = tl.load(qz_ptr + grp * (N // 8) + rows // 8, mask=rmask, other=0)
    return words, sc, ((zw >> zshift) & 0xF) + ZOFF


@triton.jit
def _rows_x(x_ptr, perm_ptr, kk, mm, M, K, HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr, KAXIS: tl.constexpr):
    """x[m, k] of the batch's rows m = mm, inputs k = kk (1-D each) in the held input order (x[m, perm[k]] with a
    desc_act order), 0 past M or K: [len(kk), len(mm)] when KAXIS is 0, else [len(mm), len(kk)]; x's dtype."""
    kmask = kk < K
    idx = kk
    if HAS_PERM:
        if EVEN_K:
            idx = tl.load(perm_ptr + kk)
        else:
            idx = tl.load(perm_ptr + kk, mask=kmask, other=0)
    if KAXIS == 0:
        ptr = x_ptr + mm[None, :] * K + idx[:, None]
        mask = (mm < M)[None, :]
        if not EVEN_K:
            mask = mask & kmask[:, None]
    else:
        ptr = x_ptr + mm[:, None] * K + idx[None, :]
        mask = (mm < M)[:, None]
        if not EVEN_K:
            mask = mask & kmask[None, :]
    return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def _q_minus_z(q, z, dt: tl.constexpr, MAGIC: tl.constexpr, F32: tl.constexpr):
    """q - z [BLOCK_N, BLOCK_K] (q [BLOCK_N, BLOCK_K], z [BLOCK_N] ints <= 16) in 16-bit dt with no int-to-float
    conversion: MAGIC is the bits of a power of two whose unit in the last place is 1, so ``v | MAGIC`` (and
    MAGIC + z) read as dt is that power plus v, and the difference of two such is exact. F32: the difference
    taken in float32 (the interpreter subtracts bf16 bits as integers), the same values."""
    zq = (z + MAGIC).to(tl.int16).to(dt, bitcast=True)
    qq = (q | MAGIC).to(tl.int16).to(dt, bitcast=True)
    if F32:
        return qq.to(tl.float32) - zq.to(tl.float32)[:, None]
    return qq - zq[:, None]


@triton.jit
def int4_rows_kernel(qw_ptr, qz_ptr, s_ptr, x_ptr, perm_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, KW, KS,
                     HAS_BIAS: tl.constexpr, HAS_PERM: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GS: tl.constexpr, ZOFF: tl.constexpr, DOT: tl.constexpr,
                     DOT_F32: tl.constexpr, EMU: tl.constexpr, SPLIT: tl.constexpr = 1,
                     EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False, TB: tl.constexpr = 0,
                     TW: tl.constexpr = 16, STAGES: tl.constexpr = 1):
    """y [M, N] = x [M, K] @ W^T (+ b) for M <= M_PAD rows (engine.kernels.gemv_int4.launch_rows): program
    (row block program_id(0) of BLOCK_N outputs, slice program_id(1) of K) walks its slice a tile of BLOCK_K
    inputs (inside one group) at a time, loads each weight word once and accumulates every row's sums in
    acc [BLOCK_N, M_PAD] float32. The tile's partial sums are exact products (q - z) x summed in float32, then
    times the group's scale:
    - DOT: the tile's nibbles in the input order (a [BLOCK_N, BLOCK_K] tile), made 16-bit without an int-to-float
      conversion (``q | 0x6400`` read as fp16 is 1024 + q, ``q | 0x4300`` as bf16 is 128 + q; minus the same
      for z: q - z exactly) and multiplied with x's tile [BLOCK_K, M_PAD] by tl.dot with float32 accumulation
      (tensor cores from sm_80, summing as the hardware sums; FMA code on sm_70). M_PAD >= 16 (tl.dot's least).
      DOT_F32: both operands float32 (IEEE), for float32 activations and for the interpreter (it multiplies
      16-bit tiles wrongly).
    - else (FMA): per nibble plane j ``(w >> 4j & 0xF) | 2^23`` as a float minus 2^23 + z (q - z exactly)
      times x's inputs 8 i + j, a [BLOCK_N, M_PAD, BLOCK_K / 8] broadcast multiply-add summed over the words,
      M_PAD a power of two >= M (float32 throughout: no tensor cores needed, M_PAD FMAs per weight).
    With split-K the last program of a row block adds the slices' sums in slice order (the same result whichever
    finishes last), then bias (float32) and one rounding to y's dtype, as int4_gemv_kernel.
    STAGES 2: the next tile's words, scales, zero points (and the DOT form's x tile) are loaded before this tile's
    arithmetic, as int4_gemv_kernel's one tile ahead; 1: each tile's loads, then its arithmetic."""
    pid, pk = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    SW: tl.constexpr = BLOCK_K // 8  # words per row per tile
    wcols = tl.arange(0, SW)
    mcols = tl.arange(0, M_PAD)
    zshift = (rows % 8) * 4
    wp = _row_words(qw_ptr, rows, wcols, KW, TB, TW)
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    kwbeg = pk * KS
    kwend = tl.minimum(kwbeg + KS, KW)
    UNM: tl.constexpr = EVEN_K and EVEN_N  # no masks on the word loads
    klast = kwbeg + ((kwend - kwbeg - 1) // SW) * SW  # the slice's last tile (every slice holds one: launch_rows)
    if STAGES == 2:
        t = _rows_tile(wp, s_ptr, qz_ptr, kwbeg, rows, rmask, zshift, N, SW, GS, ZOFF, UNM, (kwbeg + wcols) < KW,
                       TB, TW)
        if DOT:
            xt = _rows_x(x_ptr, perm_ptr, kwbeg * 8 + tl.arange(0, BLOCK_K), mcols, M, K, HAS_PERM, EVEN_K, 0)
    for kw in range(kwbeg, kwend, SW):
        if STAGES == 2:
            kn = tl.multiple_of(tl.minimum(kw + SW, klast), SW)  # past the slice: its last tile again, not summed
            nxt = _rows_tile(wp, s_ptr, qz_ptr, kn, rows, rmask, zshift, N, SW, GS, ZOFF, UNM, (kn + wcols) < KW,
                             TB, TW)
            words, sc, z = t
            if DOT:
                xn = _rows_x(x_ptr, perm_ptr, kn * 8 + tl.arange(0, BLOCK_K), mcols, M, K, HAS_PERM, EVEN_K, 0)
        else:
            words, sc, z = _rows_tile(wp, s_ptr, qz_ptr, kw, rows, rmask, zshift, N, SW, GS, ZOFF, UNM,
                                      (kw + wcols) < KW, TB, TW)
            if DOT:
                xt = _rows_x(x_ptr, perm_ptr, kw * 8 + tl.arange(0, BLOCK_K), mcols, M, K, HAS_PERM, EVEN_K, 0)
        if DOT:  # xt: [BLOCK_K, M_PAD]
            q = tl.reshape((words[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 0xF, (BLOCK_N, BLOCK_K))
            if dt == tl.float32:
                wq = (q - z[:, None]).to(tl.float32)
            elif dt == tl.bfloat16:
                wq = _q_minus_z(q, z, dt, 0x4300, DOT_F32)  # bf16 128.0: the bits of 128 + v for 0 <= v < 128
            else:
                wq = _q_minus_z(q, z, dt, 0x6400, DOT_F32)  # fp16 1024.0: the bits of 1024 + v for 0 <= v < 1024
            if DOT_F32:
                d = tl.dot(wq.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
            else:
                d = tl.dot(wq, xt)
            acc += sc[:, None] * d
        else:
            zf = 8388608.0 + z.to(tl.float32)
            part = tl.zeros((BLOCK_N, M_PAD, SW), dtype=tl.float32)
            for j in tl.static_range(8):
                qj = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf[:, None]
                xj = _rows_x(x_ptr, perm_ptr, kw * 8 + 8 * wcols + j, mcols, M, K, HAS_PERM, EVEN_K, 1)
                part += qj[:, None, :] * xj.to(tl.float32)[None, :, :]
            acc += sc[:, None] * tl.sum(part, axis=2)
        if STAGES == 2:
            t = nxt
            if DOT:
                xt = xn
    at = mcols[None, :] * N + rows[:, None]  # y [M, N]
    mask = rmask[:, None] & (mcols < M)[None, :]
    if SPLIT > 1:
        # every slice's sums to part [SPLIT, M, N]; the last program of this row block to finish adds them in
        # slice order and resets the block's counter for the next call (int4_gemv_kernel's protocol)
        tl.store(part_ptr + pk * M * N + at, acc, mask=mask)
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:
            y = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
            for j in range(0, SPLIT):
                y += tl.load(part_ptr + j * M * N + at, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + pid, 0)
            if HAS_BIAS:
                y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptr + at, rnd(y, y_ptr.dtype.element_ty, EMU), mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + at, rnd(acc, y_ptr.dtype.element_ty, EMU), mask=mask)
