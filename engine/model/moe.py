"""Qwen3-Next's MLP kind ``moe``: routed experts plus a gated shared expert (engine.core.moe's arithmetic; TP2:
every expert's gate/up rows and down columns split, router and shared gate replicated; a MoE model exchanges
through the path's allreduce). The shared expert is a DenseMLP (engine.model.base), decoded through its path."""

from __future__ import annotations

import torch

from engine.core import moe
from engine.core.config import ModelConfig
from engine.model.base import DenseMLP, Step, rms_norm


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
