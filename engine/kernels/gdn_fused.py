"""A Gated DeltaNet layer's decode step in three kernels (kernel choice ``fused``), as
engine.model.gdn.GatedDeltaNet runs it:

  1. GEMV with the norm prologue (engine.kernels.gemv.linear_norm): RMSNorm(x + delta) @ w_in^T, the four input
     projections in one product -> [conv channels q | k | v, z, b, a].
  2. ``gdn_decode``: one program per value head does the rest of the token's work: the causal conv of its
     channels over the ring (engine.kernels.gdn's layout: slot p % kernel holds position p's input; the program
     writes this position's slot and reads the kernel - 1 before it, never a slot another program writes),
     SiLU, L2 norms of q and k, beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), the delta rule on its
     float32 state [dk, dv] (read once, written once), the output and the gated RMSNorm -> y [value dim].
  3. out_proj GEMV (engine.kernels.gemv.linear_send, which can also send its rows to the TP2 peer).

Rounding follows Hugging Face's eager Qwen3.5 (the conv rounded to the dtype and SiLU of it rounded, beta in the
dtype, g and the rule in float32, the rule's output rounded, the gated norm as Qwen3_5RMSNormGated rounds it).
Nothing depends on pos's value on the host: one CUDA graph serves every position.
"""

from __future__ import annotations

import torch

from engine.kernels.interpreter import interpreting


def supported(dk: int, dv: int) -> bool:
    """Head sizes the kernel holds in one program: powers of two up to 256."""
    return all(16 <= n <= 256 and n & (n - 1) == 0 for n in (dk, dv))


def gdn_decode(proj: torch.Tensor, conv_ring: torch.Tensor, conv_w: torch.Tensor, a_log: torch.Tensor,
               dt_bias: torch.Tensor, gnorm: torch.Tensor, rec_state: torch.Tensor, pos: torch.Tensor, *, nk: int,
               nv: int, dk: int, dv: int, eps: float) -> torch.Tensor:
    """proj [conv channels + z + b + a] (one row) -> y [nv dv] in proj's dtype; conv ring and state updated."""
    from engine.kernels import gdn_decode_jit

    y = torch.empty(nv * dv, dtype=proj.dtype, device=proj.device)
    gdn_decode_jit.gdn_decode_kernel[(nv,)](
        proj.reshape(-1), conv_ring, conv_w, a_log, dt_bias, gnorm, rec_state, y, pos, float(eps), NK=nk, NV=nv,
        DK=dk, DV=dv, KSIZE=conv_w.shape[1], EMU=interpreting() and proj.dtype == torch.bfloat16,
        num_warps=8 if dk * dv >= 8192 else 4)
    return y
