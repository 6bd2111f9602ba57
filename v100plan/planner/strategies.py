"""The four ways to use the cards, as geometry: what each GPU holds and reads per round.

single       one card holds and reads everything.
replicas     every card holds a full copy and serves its own stream (FACTS.md: 42 tok/s
             each, 84 together; no single request gets faster).
layer_split  each card holds half the layers; within one round the cards take turns,
             so one stream reads the same bytes as on one card (FACTS.md: 50 vs 50.7 tok/s).
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


def kv_share_tp2(kv_heads: int) -> float:
    """Share of the KV cache per rank under TP2: ceil(kv_heads / 2) / kv_heads (a single KV head is replicated)."""
    return math.ceil(kv_heads / 2) / kv_heads


def layout(name: str, model: Model, gpus: int) -> Layout:
    """Geometry of strategy ``name`` for ``model`` on ``gpus`` cards (formulas in the module docstring)."""
    w = model.weights_total_gb
    if name == "single":
        return Layout(name, 1, 1, 1, w, model.decode_read_gb, 1.0, 1.0, 0)
    if name == "replicas":
        return Layout(name, 2, max(gpus, 2), 1, w, model.decode_read_gb, 1.0, 1.0, 0)
    if name == "layer_split":
        # Balanced halves: each card holds half the file and half of each sequence's KV;
        # the round visits both halves in turn, so the critical path reads all of it.
        return Layout(name, 2, 1, 1, w / 2, model.decode_read_gb, 0.5, 1.0, 2)
    if name == "tp2":
        share = kv_share_tp2(model.kv_heads)
        per_rank = model.weights_replicated_gb + model.weights_split_gb / 2
        read = model.decode_read_gb - model.weights_split_gb / 2
        return Layout(name, 2, 1, 2, per_rank, read, share, share, 0)
    raise ValueError(f"unknown strategy {name!r}")
