"""Qwen3-Next's sparse MLP: a router picks k of E experts per token (softmax in float32, top-k, renormalised
when ``norm_topk_prob``), each a SwiGLU MLP of moe_intermediate_size, plus a shared SwiGLU expert scaled by
sigmoid(shared_expert_gate . h). The output is sum_j w_j expert_j(h) + sigmoid(g . h) shared(h).

The layer holds (engine.core.model.Layer, this rank's part):
  router [E, D] and shared_gate [1, D]  replicated: every rank routes every token the same way
  ew13 [E, 2 fe, D]                     every expert's [gate | up] rows of this rank (fe = moe width / world)
  ew2 [E, D, fe]                        every expert's down_proj columns of this rank
  w13 [2 fs, D], w2 [D, fs]             the shared expert, as a dense MLP's (fs = shared width / world)
so each rank's output is a partial sum that the MLP's allreduce completes, as for a dense MLP.

Two forms: ``prefill`` loops over the experts some token chose (a host sync per layer and chunk, fine outside
the decode step); ``decode`` is the one-token form inside THE decode step: top-k on the device and the k
chosen experts' matrices gathered with index_select into two batched products, no host sync and no
data-dependent Python control flow, so it is captured in the step's CUDA graph."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(h: torch.Tensor, router: torch.Tensor, k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, D] -> (weights [T, k] in h's dtype, expert indices [T, k]) as transformers' Qwen3NextTopKRouter."""
    probs = torch.softmax(F.linear(h, router), dim=-1, dtype=torch.float32)  # [T, E]
    top, idx = torch.topk(probs, k, dim=-1)
    if norm_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(h.dtype), idx


def prefill(h: torch.Tensor, router, shared_gate, ew13, ew2, w13, w2, *, k: int, norm_topk: bool,
            shared) -> torch.Tensor:
    """h [1, T, D] (normed) -> the MoE MLP's partial output [1, T, D]. ``shared(h, w13, w2)``: the dense MLP
    (the shared expert's product)."""
    x = h[0]  # [T, D]
    weights, idx = route(x, router, k, norm_topk)
    out = torch.zeros_like(x)
    fe = ew2.shape[-1]
    for e in torch.unique(idx).tolist():  # only the experts some token chose
        tok, slot = torch.where(idx == e)
        gate, up = F.linear(x[tok], ew13[e]).split([fe, fe], dim=-1)
        y = F.linear(F.silu(gate) * up, ew2[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y)
    out = out + gate_scale(x, shared_gate) * shared(x, w13, w2)
    return out[None]


def decode(h: torch.Tensor, router, shared_gate, ew13, ew2, *, k: int, norm_topk: bool) -> torch.Tensor:
    """h [1, 1, D] (normed) -> the routed experts' partial output [1, 1, D] (the shared expert is the caller's:
    engine.core.model.moe_block). Capturable: every shape is fixed by k, E and the widths."""
    x = h.view(1, -1)  # [1, D]
    weights, idx = route(x, router, k, norm_topk)  # [1, k] each, on the device
    idx = idx.view(k)
    fe = ew2.shape[-1]
    gu = torch.bmm(ew13.index_select(0, idx), x.expand(k, -1).unsqueeze(-1))  # [k, 2 fe, 1]
    gate, up = gu.split([fe, fe], dim=1)
    y = torch.bmm(ew2.index_select(0, idx), F.silu(gate) * up)  # [k, D, 1]
    return (y.squeeze(-1) * weights.view(k, 1)).sum(0).view(1, 1, -1)


def gate_scale(h: torch.Tensor, shared_gate: torch.Tensor) -> torch.Tensor:
    """sigmoid(shared_expert_gate . h): the shared expert's scale, [..., 1]."""
    return torch.sigmoid(F.linear(h, shared_gate))
