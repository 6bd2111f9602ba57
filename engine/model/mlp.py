"""The MLP kinds (the config's mlp_types): ``dense``, the SwiGLU MLP (weights w13 = gate | up rows, w2; TP2:
gate/up rows and down columns split, down into the exchange), and ``moe``, Qwen3-Next's routed experts plus a
gated shared expert (engine.core.moe's arithmetic; TP2: every expert's gate/up rows and down columns split,
router and shared gate replicated; a MoE model exchanges through the path's allreduce). Decode: the torch form, or
(kernel choice "fused") norm + gate/up GEMV and SiLU(gate) * up + down GEMV."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.core import moe
from engine.core.config import ModelConfig
from engine.core.quant import matmul
from engine.kernels import decode
from engine.model.base import Block, Step, rms_norm


class DenseMLP(Block):
    kind = "dense"
    WEIGHTS = ("post_norm", "w13", "b13", "w2", "b2")

    def __init__(self, cfg: ModelConfig, world: int, e: dict, m: dict, ff: int | None = None):
        d = cfg.hidden_size
        self.eps, self.zc = cfg.rms_norm_eps, cfg.zero_centred_norm
        self.ff = (ff or cfg.intermediate_size) // world
        self.post_norm = torch.empty(d, **e)
        self.w13 = torch.empty(2 * self.ff, d, **m)  # rows: [gate | up] of this rank
        self.b13 = torch.empty(2 * self.ff, **e) if cfg.mlp_bias else None
        self.w2 = torch.empty(d, self.ff, **m)
        self.b2 = torch.empty(d, **e) if cfg.mlp_bias else None  # added by rank 0 only

    def prefill(self, h: torch.Tensor, rank: int) -> torch.Tensor:
        """h [B, T, D] (normed) -> down_proj partial."""
        return self.dense(h, self.w13, self.b13, self.w2, self.bias_once(self.b2, rank))

    @staticmethod
    def dense(h, w13, b13, w2, b2) -> torch.Tensor:
        gate, up = matmul(h, w13, b13).chunk(2, dim=-1)  # [B, T, ff] each
        return matmul(F.silu(gate) * up, w2, b2)

    def decode(self, x: torch.Tensor, delta: torch.Tensor, s: Step, send=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x, delta [1, 1, D] -> (x + delta, down_proj partial [1, 1, D]) (``send``: as FullAttention.decode's)."""
        return self.swiglu(x, delta, s, self.b13, self.bias_once(self.b2, s.rank), send)

    def swiglu(self, x, delta, s: Step, b13, b2, send=None):
        if s.fused and decode.runs_here(x.device):
            gu, x = decode.linear_norm(x, delta, self.post_norm, self.eps, self.w13, b13, zc=self.zc)
            return x, decode.linear_silu(gu, self.w2, b2, send=send)
        x = x + delta  # the mixer's reduced output
        h = rms_norm(x, self.post_norm, self.eps, self.zc)
        gate, up = matmul(h, self.w13, b13).chunk(2, dim=-1)  # [1, 1, ff] each
        return x, matmul(F.silu(gate) * up, self.w2, b2)


class MoE(DenseMLP):
    """w13 / w2 are the shared expert; router [E, D], ew13 [E, 2 fe, D], ew2 [E, D, fe], shared_gate [1, D]."""

    kind = "moe"
    WEIGHTS = DenseMLP.WEIGHTS + ("router", "shared_gate", "ew13", "ew2")

    def __init__(self, cfg: ModelConfig, world: int, e: dict, m: dict):
        super().__init__(cfg, world, e, m, ff=cfg.shared_expert_intermediate_size)
        d, fe = cfg.hidden_size, cfg.moe_intermediate_size // world
        self.router = torch.empty(cfg.num_experts, d, **e)  # replicated
        self.shared_gate = torch.empty(1, d, **e)  # replicated
        self.ew13 = torch.empty(cfg.num_experts, 2 * fe, d, **e)  # per expert: [gate | up] rows of this rank
        self.ew2 = torch.empty(cfg.num_experts, d, fe, **e)  # per expert: down_proj columns of this rank
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def prefill(self, h: torch.Tensor, rank: int) -> torch.Tensor:
        return moe.prefill(h, self.router, self.shared_gate, self.ew13, self.ew2, self.w13, self.w2, k=self.top_k,
                           norm_topk=self.norm_topk, shared=lambda x, w13, w2: self.dense(x, w13, None, w2, None))

    def decode(self, x: torch.Tensor, delta: torch.Tensor, s: Step, send=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared expert through the path's SwiGLU (fused or not) scaled by its sigmoid gate, plus the k routed
        experts on the device (engine.core.moe.decode: no host sync, captured with the step). No ticket: the
        exchange is the path's allreduce."""
        x, shared = self.swiglu(x, delta, s, None, None)
        h = rms_norm(x, self.post_norm, self.eps, self.zc)
        # a batched step (engine.core.model.Model.decode_batch) routes row by row: each row picks its own experts
        rows = [moe.decode(h[i:i + 1], self.router, self.shared_gate, self.ew13, self.ew2, k=self.top_k,
                           norm_topk=self.norm_topk) for i in range(h.shape[0])]
        routed = rows[0] if len(rows) == 1 else torch.cat(rows)
        return x, routed + moe.gate_scale(h, self.shared_gate) * shared
