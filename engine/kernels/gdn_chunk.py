"""The chunked gated delta rule's prefill in Triton (kernel choice ``fused``), the arguments and results of
engine.kernels.gdn.chunked, in two launches per layer and prefill chunk:

  1. ``gdn_chunk_prep_kernel``, one program per (value head, 64-token chunk), all chunks at once: the intra-chunk
     parts of engine.kernels.gdn.chunk_parts. q and k L2-normalised (q scaled), the decays from the cumulative gates,
     A = (beta k k^T) decay and attn = (q k^T) decay, the UT transform's (I + A)^-1 (the four 16 x 16 diagonal
     blocks by forward substitution, the blocks below them by products, through a float32 scratch tile), then
     u = (I + A)^-1 beta v and w = (I + A)^-1 beta k exp(cum), q exp(cum) and k exp(cum_last - cum).
  2. ``gdn_chunk_kernel``: the sequential part. A program owns (value head, block of BV value columns) and walks
     the chunks in order with its block of the state S [dk, BV] in registers (float32): vn = u - w S;
     out = (q exp(cum)) S + attn vn; S = S exp(cum_last) + (k exp(cum_last - cum))^T vn. The state comes from the
     layer's recurrent state (a continued sequence) and goes back to it.

The parts' products are float32 (tf32 tensor cores where the card has them); what they hand to the sequential
kernel is in the model's dtype, whose products take S and vn rounded to it (as flash-linear-attention's
chunk_delta_h does), every sum and the state in float32. A float32 model gets IEEE float32 products throughout
(the CPU tests, under Triton's interpreter, equal engine.kernels.gdn's forms to float32 noise). The kernels are
engine.kernels.gdn_chunk_jit's.
"""

from __future__ import annotations

import torch

from engine.kernels import gdn
from engine.kernels.interpreter import interpreting


def supported(dk: int, dv: int) -> bool:
    """Head sizes the kernel holds: powers of two from 16 (tensor-core tiles) to 256 (registers)."""
    return all(16 <= n <= 256 and n & (n - 1) == 0 for n in (dk, dv))


def prepare(q, k, v, g, beta, chunk: int = 64):
    """The intra-chunk parts in one launch (``gdn_chunk_prep_kernel``): the results of engine.kernels.gdn.chunk_parts,
    in v's dtype (last in float32)."""
    from engine.kernels import gdn_chunk_jit

    t, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    n = -(-t // chunk)
    dtype, dev = v.dtype, v.device
    q, k, v = (x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous() for x in (q, k, v))
    u = torch.empty(hv, n, chunk, dv, dtype=dtype, device=dev)
    w, qd, kd = (torch.empty(hv, n, chunk, dk, dtype=dtype, device=dev) for _ in range(3))
    attn = torch.empty(hv, n, chunk, chunk, dtype=dtype, device=dev)
    last = torch.empty(hv, n, dtype=torch.float32, device=dev)
    scratch = torch.empty(hv * n, chunk, chunk, dtype=torch.float32, device=dev)
    gdn_chunk_jit.gdn_chunk_prep_kernel[(hv, n)](
        q, k, v, g.float().contiguous(), beta.float().contiguous(), u, w, qd, kd, attn, last, scratch, t, n,
        q.stride(0), k.stride(0), v.stride(0), NV=hv, RATIO=hv // hk, DK=dk, DV=dv, C=chunk,
        IEEE=dtype == torch.float32, EMU=interpreting() and dtype == torch.bfloat16, num_warps=4)
    return u, w, attn, qd, kd, last, t


def chunked(q, k, v, g, beta, state, chunk: int = 64, bv: int | None = None, num_stages: int | None = None,
            prep: str = "kernel"):
    """engine.kernels.gdn.chunked in two launches: q, k [T, Hk, dk], v [T, Hv, dv] (the model's dtype), g, beta
    [T, Hv], state [Hv, dk, dv] float32 -> (o [T, Hv, dv] float32, the final state). ``bv``: value columns per
    program (default min(32, dv)); ``prep`` "torch": the intra-chunk parts by engine.kernels.gdn.chunk_parts instead
    (torch's triangular solve; the comparison the bench and the tests make)."""
    from engine.kernels import gdn_chunk_jit

    dtype = v.dtype
    if prep == "torch":
        parts = gdn.chunk_parts(q, k, v, g, beta, chunk)
    else:
        if chunk != 64:
            raise ValueError("the prefill kernel's chunk is 64 tokens (four 16 x 16 blocks of the UT transform)")
        parts = prepare(q, k, v, g, beta, chunk)
    u, w, attn, qd, kd, last, t = parts
    h, n, c, dv = u.shape
    dk = w.shape[-1]
    bv = bv or min(32, dv)
    s = state.float().clone().contiguous()
    out = torch.empty(h, n * c, dv, dtype=torch.float32, device=u.device)
    if num_stages is None and dtype == torch.float32:
        num_stages = 1  # float32 tiles pipelined three deep need 256 KiB of shared memory (an H200 has 227 KiB)
    kw = {} if num_stages is None else {"num_stages": num_stages}
    gdn_chunk_jit.gdn_chunk_kernel[(h, dv // bv)](
        *(x.to(dtype).contiguous() for x in (u, w, qd, kd, attn)), last.contiguous(), s, out, n, DK=dk, DV=dv, BV=bv,
        C=c, IEEE=dtype == torch.float32, EMU=interpreting() and dtype == torch.bfloat16, num_warps=4, **kw)
    return out[:, :t].transpose(0, 1), s
