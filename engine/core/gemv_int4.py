"""The decode step's one-row products on packed 4-bit weights (engine.core.quant.PackedLinear), in Triton.

y [N] = W [N, K] @ h [K] with W read as it is held: int32 words of eight 4-bit values along K, a 4-bit zero point
and a scale per (group, output). Each program owns BLOCK_N output rows and walks K in tiles of BLOCK_K: it loads
BLOCK_K / 8 words per row (one 16-byte vector per four words), unpacks them in registers, and applies the group's
scale and zero point once per group and row:
    y[n] = sum over groups g of s[g, n] * (sum_k q[n, k] h[k] - z[g, n] * sum_k h[k])
so the bytes read are the packed weights, the zero points and the scales, nothing dequantised. Two forms of the
loop (ELEMENTWISE; the bench times both): the products kept element-wise over a group's tiles and scaled once per
group (no reduction inside the loop), or reduced to per-group sums in every tile. The input row h is
made by the same prologues as engine.core.gemv's bf16 GEMV (kernel choice "fused"): the residual add + RMSNorm
(Hugging Face's rounding) or SiLU(gate) * up, and the output rows can go, tagged, to the peer's inbox (the TP2
exchange of engine.allreduce.epilogue, mode "send"); float32 sums in a fixed order, as there.
A desc_act checkpoint's input order (PackedLinear.perm) is followed by reading h at perm[k].

Prefill chunks do not come here: PackedLinear.linear dequantises the matrix for the chunk (``dequantise``, one
Triton kernel) and multiplies with cuBLAS.
"""

from __future__ import annotations

import functools
import json
import os

import torch

from engine.core import gemv

DEFAULT_BLOCKS = (32, 128, 4)  # (BLOCK_N, BLOCK_K, num_warps), not measured yet: python -m engine.bench.int4 sets BLOCKS
BLOCKS: dict[tuple[str, int, int], tuple[int, int, int]] = {}
BLOCKS_ENV = "V100PLAN_ENGINE_INT4_BLOCKS"  # the bench's JSON: {"best_blocks": {"norm:NxK": [BN, BK, warps, ew]}}
FORMS: dict[tuple[str, int, int], bool] = {}  # (prologue, N, K) -> ELEMENTWISE, from the same file


def _load_blocks() -> None:
    path = os.environ.get(BLOCKS_ENV)
    if not path:
        return
    with open(path) as fh:
        raw = json.load(fh)
    for key, val in raw.get("best_blocks", raw).items():
        name, shape = key.split(":")
        n, k = (int(v) for v in shape.split("x"))
        BLOCKS[(name, n, k)] = tuple(int(v) for v in val[:3])
        if len(val) > 3:
            FORMS[(name, n, k)] = bool(val[3])


_load_blocks()
# the main loop's form (the bench times both): True = products summed element-wise per group, scaled once per group
# (BLOCK_K at most the group size); False = per tile, a reduction to per-group sums, then scale and zero point
ELEMENTWISE = True


@functools.cache
def _kernels():
    # Triton resolves triton.language and the functions a kernel calls through the module's globals
    global tl, rnd, _normed, _norm_stats, _xs_send, _row
    import triton
    import triton.language as tl

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
    def int4_gemv_kernel(qw_ptr, qz_ptr, s_ptr, perm_ptr, x_ptr, d_ptr, nw_ptr, b_ptr, y_ptr, xo_ptr, N, K, eps,
                         xs_peer, xs_ser, xs_slot, xs_e, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
                         HAS_PERM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GS: tl.constexpr,
                         ZOFF: tl.constexpr, EMU: tl.constexpr, STATS_BLOCK: tl.constexpr, SEND: tl.constexpr,
                         EPW: tl.constexpr, ELEMENTWISE: tl.constexpr = True, ZC: tl.constexpr = False):
        pid = tl.program_id(0)
        dt = x_ptr.dtype.element_ty
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        WK: tl.constexpr = BLOCK_K // 8  # words per row per tile
        rstd = 0.0
        if PROLOGUE == 1:  # statistics of x + delta (rounded), float32, natural order, the whole row
            rstd = _norm_stats(x_ptr, d_ptr, xo_ptr, K, pid, eps, dt, EMU, STATS_BLOCK)
        cols0 = tl.arange(0, BLOCK_K)
        wcols = tl.arange(0, WK)
        zshift = (rows % 8) * 4
        KW = K // 8
        wp = qw_ptr + rows[:, None].to(tl.int64) * KW + wcols[None, :]
        # nibble -> float without an int-to-float conversion (a quarter-rate instruction: it would cap the kernel near
        # half the H200's bandwidth): the value ORed into the mantissa of 2^23, minus 2^23, exact
        if ELEMENTWISE:
            # Per group (BLOCK_K <= GS): products summed element-wise over the group's tiles, scaled once per group
            # and row; one reduction over K at the end. Each 16-bit half of a word gives its four values by one mask
            # each, left in place (value x 16^j), and h is scaled by 16^-j instead (exact: powers of two).
            masks = 0xF << (tl.arange(0, 4) * 4)
            jscale = tl.exp2(-4.0 * (cols0 % 4).to(tl.float32))
            tot = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            corr = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for g0 in range(0, K, GS):
                accg = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
                hsv = tl.zeros((BLOCK_K,), dtype=tl.float32)
                for t in range(0, GS, BLOCK_K):
                    k0 = g0 + t
                    words = tl.load(wp + k0 // 8, mask=rmask[:, None] & ((k0 // 8 + wcols) < KW)[None, :], other=0,
                                    eviction_policy="evict_first")  # [BLOCK_N, WK] int32
                    halves = tl.join(words & 0xFFFF, (words >> 16) & 0xFFFF)  # [BLOCK_N, WK, 2]
                    qs = tl.reshape((halves[:, :, :, None] & masks[None, None, None, :]) | 0x4B000000,
                                    (BLOCK_N, BLOCK_K)).to(tl.float32, bitcast=True) - 8388608.0  # q x 16^j
                    h = _row(x_ptr, d_ptr, nw_ptr, perm_ptr, k0, cols0, K, rstd, dt, PROLOGUE, HAS_PERM, EMU, ZC)
                    accg += qs * (h * jscale)[None, :]
                    hsv += h
                grp = g0 // GS
                sc = tl.load(s_ptr + grp * N + rows, mask=rmask, other=0.0).to(tl.float32)
                zw = tl.load(qz_ptr + grp * (N // 8) + rows // 8, mask=rmask, other=0)
                z = ((zw >> zshift) & 0xF).to(tl.float32) + ZOFF
                tot += sc[:, None] * accg
                corr += sc * z * tl.sum(hsv, axis=0)
            y = tl.sum(tot, axis=1) - corr
        else:
            # Per tile: the sums of q h and of h per group within the tile (a reduction per tile), the group's
            # scale and zero point applied to them.
            SUB: tl.constexpr = BLOCK_K if BLOCK_K < GS else GS  # inputs per group within a tile
            NG: tl.constexpr = BLOCK_K // SUB  # groups per tile
            shifts = tl.arange(0, 8) * 4
            gsel = tl.arange(0, NG)
            acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                words = tl.load(wp + k0 // 8, mask=rmask[:, None] & ((k0 // 8 + wcols) < KW)[None, :], other=0,
                                eviction_policy="evict_first")  # [BLOCK_N, WK] int32
                q = (tl.reshape(((words[:, :, None] >> shifts[None, None, :]) & 0xF) | 0x4B000000,
                                (BLOCK_N, BLOCK_K)).to(tl.float32, bitcast=True) - 8388608.0)
                h = _row(x_ptr, d_ptr, nw_ptr, perm_ptr, k0, cols0, K, rstd, dt, PROLOGUE, HAS_PERM, EMU, ZC)
                part = tl.sum(tl.reshape(q * h[None, :], (BLOCK_N, NG, SUB)), axis=2)  # [BLOCK_N, NG]
                hsum = tl.sum(tl.reshape(h, (NG, SUB)), axis=1)  # [NG]
                grp = (k0 + gsel * SUB) // GS  # [NG]
                gmask = rmask[:, None] & ((k0 + gsel * SUB) < K)[None, :]
                sc = tl.load(s_ptr + grp[None, :] * N + rows[:, None], mask=gmask, other=0.0).to(tl.float32)
                zw = tl.load(qz_ptr + grp[None, :] * (N // 8) + (rows // 8)[:, None], mask=gmask, other=0)
                z = ((zw >> zshift[:, None]) & 0xF).to(tl.float32) + ZOFF
                acc += sc * (part - z * hsum[None, :])
            y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        yd = rnd(y, y_ptr.dtype.element_ty, EMU)
        tl.store(y_ptr + rows, yd, mask=rmask)
        if SEND:  # the same rows, tagged, into the peer's inbox (engine.core.gemv's epilogue)
            _xs_send(yd, pid, rows, rmask, N, xs_peer, xs_ser, xs_slot, xs_e, BLOCK_N, EPW)

    @triton.jit
    def dequant_kernel(qw_ptr, qz_ptr, s_ptr, out_ptr, N, K, GS: tl.constexpr, ZOFF: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # out [N, K] = s * (q - z) in the held input order, rounded once to out's dtype
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        m = (rows < N)[:, None] & (cols < K)[None, :]
        words = tl.load(qw_ptr + rows[:, None].to(tl.int64) * (K // 8) + (cols // 8)[None, :], mask=m, other=0)
        q = ((words >> ((cols % 8) * 4)[None, :]) & 0xF).to(tl.float32)
        g = cols // GS
        sc = tl.load(s_ptr + g[None, :] * N + rows[:, None], mask=m, other=0.0).to(tl.float32)
        zw = tl.load(qz_ptr + g[None, :] * (N // 8) + (rows // 8)[:, None], mask=m, other=0)
        z = ((zw >> ((rows % 8) * 4)[:, None]) & 0xF).to(tl.float32) + ZOFF
        tl.store(out_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], (sc * (q - z)).to(out_ptr.dtype.element_ty),
                 mask=m)

    return int4_gemv_kernel, dequant_kernel


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch(prologue: int, x: torch.Tensor, w, b: torch.Tensor | None, out: torch.Tensor,
           delta: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
           x_out: torch.Tensor | None = None, blocks: tuple[int, int, int] | None = None, send=None,
           elementwise: bool | None = None, zc: bool = False) -> torch.Tensor:
    """out [N] = W @ h (+ b), h made from x by the prologue (engine.core.gemv's PROLOGUE_PLAIN / NORM / SILU; x: [K],
    or [2K] = [gate | up] for SiLU); NORM writes x + delta into x_out [K]. ``send``: as gemv.launch_prologue's."""
    n, k = w.shape
    name = gemv.PROLOGUE_NAMES[prologue]
    bn, bk, warps = blocks or BLOCKS.get((name, n, k), DEFAULT_BLOCKS)
    if gemv.interpreting() and blocks is None:
        bn = 32  # the interpreter runs programs one after another: fewer, wider ones
    elementwise = FORMS.get((name, n, k), ELEMENTWISE) if elementwise is None else elementwise
    bk = min(bk, _pow2_at_least(k))
    if elementwise and w.group_size < k:
        bk = min(bk, w.group_size)  # a tile inside one group
    gs = w.group_size if w.group_size < k else -(-k // bk) * bk  # one group over all inputs: whole tiles of it
    if gs % min(bk, gs) or bk % 8:
        raise ValueError(f"int4 GEMV: BLOCK_K {bk} and group size {gs} must nest (powers of two, at least 8)")
    t = out
    peer, _, ser, _, slot, e, _, _ = gemv._xs_args(send, t)
    _kernels()[0][(-(-n // bn),)](
        w.qweight, w.qzeros, w.scales, w.perm if w.perm is not None else w.qweight, x,
        delta if delta is not None else x, norm_weight if norm_weight is not None else x, b if b is not None else x,
        out, x_out if x_out is not None else out, n, k, float(eps), peer, ser, slot, e,
        PROLOGUE=prologue, HAS_BIAS=b is not None, HAS_PERM=w.perm is not None, BLOCK_N=bn, BLOCK_K=bk, GS=gs,
        ZOFF=w.zero_offset, EMU=gemv.interpreting() and x.dtype == torch.bfloat16,
        STATS_BLOCK=min(8192, _pow2_at_least(k)), SEND=send is not None, EPW=gemv._epw(out.dtype),
        ELEMENTWISE=elementwise, ZC=zc, num_warps=warps)
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
                                                           ZOFF=w.zero_offset, BLOCK_N=blocks[0], BLOCK_K=blocks[1])
    return out
