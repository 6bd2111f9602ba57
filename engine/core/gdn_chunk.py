"""The chunked gated delta rule's prefill in Triton (kernel choice ``fused``), the arguments and results of
engine.core.gdn.chunked:

  1. engine.core.gdn.chunk_parts, batched over every 64-token chunk of every value head (a few torch launches per
     layer, none per chunk): q/k normalised, the decays, A = (beta k k^T) decay and attn = (q k^T) decay, with
     ``inverse`` (one program per chunk: forward substitution over the 64 x 64 unitriangular matrix) for the UT
     transform's (I + A)^-1, then u = (I + A)^-1 beta v and w = (I + A)^-1 beta k exp(cum) in one product.
  2. ``gdn_chunk_kernel``: ONE launch per layer and prefill chunk does the sequential part. A program owns (value
     head, block of BV value columns) and walks the chunks in order with its block of the state S [dk, BV] in
     registers (float32): vn = u - w S; out = (q exp(cum)) S + attn vn; S = S exp(cum_last) + (k exp(cum_last -
     cum))^T vn. The state comes from the layer's recurrent state (a continued sequence) and goes back to it.

Inputs of the products are in the model's dtype (S and vn rounded to it for the tensor-core products, as
flash-linear-attention's chunk_delta_h does), every sum and the state in float32; float32 inputs use IEEE
float32 products (the CPU tests, under Triton's interpreter, equal engine.core.gdn's forms to float32 noise).
"""

from __future__ import annotations

import functools

import torch

from engine.core import gdn


@functools.cache
def _kernels():
    global tl, rnd, _dot
    import triton
    import triton.language as tl

    from engine.core import gemv

    gemv._prologue_kernel()
    rnd = gemv.rnd

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
    def gdn_unitri_inverse_kernel(a_ptr, inv_ptr, C: tl.constexpr):
        # (I + A)^-1 of one chunk's C x C matrix, A's strictly lower part only: row i of the inverse is
        # e_i - sum_{j < i} A_ij X_j, the rows above it final
        b = tl.program_id(0).to(tl.int64)
        cs = tl.arange(0, C)
        base = a_ptr + b * C * C
        x = (cs[:, None] == cs[None, :]).to(tl.float32)
        for i in range(1, C):
            ai = tl.load(base + i * C + cs, mask=cs < i, other=0.0)
            r = tl.sum(ai[:, None] * x, axis=0)
            x = tl.where(cs[:, None] == i, x - r[None, :], x)
        tl.store(inv_ptr + b * C * C + cs[:, None] * C + cs[None, :], x)

    @triton.jit
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

    return gdn_unitri_inverse_kernel, gdn_chunk_kernel


def supported(dk: int, dv: int) -> bool:
    """Head sizes the kernel holds: powers of two from 16 (tensor-core tiles) to 256 (registers)."""
    return all(16 <= n <= 256 and n & (n - 1) == 0 for n in (dk, dv))


def inverse(a: torch.Tensor) -> torch.Tensor:
    """a [..., C, C] float32 -> (I + A)^-1 with A its strictly lower part (the diagonal and above are not read)."""
    c = a.shape[-1]
    flat = a.reshape(-1, c, c).contiguous()
    out = torch.empty_like(flat)
    _kernels()[0][(flat.shape[0],)](flat, out, C=c, num_warps=4)
    return out.view(a.shape)


def chunked(q, k, v, g, beta, state, chunk: int = 64, bv: int | None = None, num_stages: int | None = None,
            solve=inverse):
    """engine.core.gdn.chunked with the sequential part in one kernel launch: q, k [T, Hk, dk], v [T, Hv, dv]
    (the model's dtype), g, beta [T, Hv], state [Hv, dk, dv] float32 -> (o [T, Hv, dv] float32, the final state).
    ``bv``: value columns per program (default min(32, dv)); ``solve``: the UT transform's inverse (None: torch's
    triangular solve)."""
    from engine.core.gemv import interpreting

    dtype = v.dtype
    u, w, attn, qd, kd, last, t = gdn.chunk_parts(q, k, v, g, beta, chunk, solve=solve)
    h, n, c, dv = u.shape
    dk = w.shape[-1]
    bv = bv or min(32, dv)
    s = state.float().clone().contiguous()
    out = torch.empty(h, n * c, dv, dtype=torch.float32, device=u.device)
    kw = {} if num_stages is None else {"num_stages": num_stages}
    _kernels()[1][(h, dv // bv)](*(x.to(dtype).contiguous() for x in (u, w, qd, kd, attn)), last.contiguous(), s,
                                 out, n, DK=dk, DV=dv, BV=bv, C=c, IEEE=dtype == torch.float32,
                                 EMU=interpreting() and dtype == torch.bfloat16, num_warps=4, **kw)
    return out[:, :t].transpose(0, 1), s
