"""The four ways to use the cards, as geometry: what each GPU holds and reads per round.

single       one card holds and reads everything.
replicas     every card holds a full copy and serves its own stream (docs/field-figures.md: 42 tok/s
             each, 84 together; no single request gets faster).
layer_split  each card holds half the layers; within one round the cards take turns,
             so one stream reads the same bytes as on one card (docs/field-figures.md: 50 vs 50.7 tok/s).
tp2          each card holds half of every split tensor plus the replicated ones and
             reads only that per round; KV heads are split between the two ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from v100plan.planner.inputs import Model

NAMES = ("single", "replicas", "layer_split", "tp2")


@dataclass(frozen=True)
class Layout:
    name: str
    gpus_needed: int
    streams: int                  # independent copies serving their own requests
    tp: int
    weights_gb_per_gpu: float     # resident weight bytes on one GPU
    weights_read_gb: float        # weight bytes on a round's critical path (summed over cards that take turns)
    kv_share: float               # share of one sequence's KV cache held (and read) by one GPU
    kv_read_share: float          # share of one sequence's KV on the round's critical path
    hops_per_round: int           # activation hand-overs between cards per round (layer_split)
    pp: int = 1                   # pipeline stages (one per node)


def wide_names(gpus_per_node: int, nodes: int, max_tp: int) -> tuple[str, ...]:
    """Strategies beyond two cards: tpN inside one box (N = 4, 8 up to the cards and the engine's limit),
    and tpN_ppM across M boxes (tensor parallel inside each box, one pipeline stage per box)."""
    names = [f"tp{n}" for n in (4, 8) if n <= gpus_per_node and n <= max_tp]
    if nodes > 1:
        n = max((t for t in (1, 2, 4, 8) if t <= gpus_per_node and t <= max_tp), default=1)
        names.append(f"tp{n}_pp{nodes}")
    return tuple(names)


def kv_share_tp(kv_heads: int, tp: int) -> float:
    """Share of the KV cache per rank under TP n: ceil(kv_heads / n) / kv_heads (heads fewer than ranks are replicated)."""
    return math.ceil(kv_heads / tp) / kv_heads


def kv_share_tp2(kv_heads: int) -> float:
    """Share of the KV cache per rank under TP2: ceil(kv_heads / 2) / kv_heads (a single KV head is replicated)."""
    return math.ceil(kv_heads / 2) / kv_heads


def expert_read_gb(model: Model, tokens_per_round: float) -> float:
    """MoE expert bytes read in one round: all experts' bytes x the expected share of experts touched
    by ``tokens_per_round`` tokens routed to ``active`` of ``experts`` each, uniformly:
    1 - (1 - active / experts) ** tokens. One token reads active / experts of them (8 / 128 = 6 %);
    a batch of 32 touches 87 %. Uniform routing is an assumption: real routers are skewed, which
    lowers the share (so this errs towards slower)."""
    if not model.moe_experts:
        return 0.0
    untouched = (1.0 - model.moe_active_experts / model.moe_experts) ** max(tokens_per_round, 1.0)
    return model.moe_expert_gb * (1.0 - untouched)


def layout(name: str, model: Model, gpus: int, tokens_per_round: float = 1.0, head_replicated: bool = False) -> Layout:
    """Geometry of strategy ``name`` for ``model`` on ``gpus`` cards (formulas in the module docstring).

    ``tokens_per_round`` (verified tokens x sequences) only matters for MoE models, whose
    per-round expert reads grow with it (see expert_read_gb). ``head_replicated``: the engine keeps the
    output head whole on every rank under tensor parallel (gpt-fast's tp.py shards attention and MLP
    only), so each rank holds and reads all of it, not 1/tp.
    """
    w = model.weights_total_gb
    read = model.decode_read_gb + expert_read_gb(model, tokens_per_round)
    if name == "single":
        return Layout(name, 1, 1, 1, w, read, 1.0, 1.0, 0)
    if name == "replicas":
        return Layout(name, 2, max(gpus, 2), 1, w, read, 1.0, 1.0, 0)
    if name == "layer_split":
        # Balanced halves: each card holds half the file and half of each sequence's KV;
        # the round visits both halves in turn, so the critical path reads all of it.
        return Layout(name, 2, 1, 1, w / 2, read, 0.5, 1.0, 2)
    if name == "tp2":
        share = kv_share_tp2(model.kv_heads)
        per_rank = model.weights_replicated_gb + model.weights_split_gb / 2
        # Every split tensor but the experts is read whole each round; each rank reads its half of it.
        dense_split = model.weights_split_gb - model.moe_expert_gb
        rank_read = model.decode_read_gb - dense_split / 2 + expert_read_gb(model, tokens_per_round) / 2
        if head_replicated:
            per_rank += model.head_gb / 2
            rank_read += model.head_gb / 2
        return Layout(name, 2, 1, 2, per_rank, rank_read, share, share, 0)
    if name.startswith("tp"):
        tp_s, _, pp_s = name[2:].partition("_pp")
        tp, pp = int(tp_s), int(pp_s or 1)
        share = kv_share_tp(model.kv_heads, tp)
        per_rank = model.weights_replicated_gb + model.weights_split_gb / tp
        dense_split = model.weights_split_gb - model.moe_expert_gb
        rank_read = model.decode_read_gb - dense_split * (1 - 1 / tp) + expert_read_gb(model, tokens_per_round) / tp
        if head_replicated:
            per_rank += model.head_gb * (1 - 1 / tp)
            rank_read += model.head_gb * (1 - 1 / tp)
        # Pipeline: each stage holds 1/pp of the layers; a round visits the stages in turn (critical path reads all).
        return Layout(name, tp * pp, 1, tp, per_rank / pp, rank_read, share / pp, share, pp - 1, pp)
    raise ValueError(f"unknown strategy {name!r}")
