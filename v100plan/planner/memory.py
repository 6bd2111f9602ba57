"""Memory per GPU and the largest context that fits.

memory per GPU = resident weights + runtime reserve
                 + concurrency x (KV bytes per token x context + recurrent state) x the GPU's share
Units: GB = 1e9 bytes; the card's capacity is its GiB x 1.0737.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import memory_fit  # stdlib-only: the engine's default context runs the same arithmetic
from v100plan.planner.inputs import Model
from v100plan.planner.strategies import Layout


@dataclass(frozen=True)
class Memory:
    weights_gb: float
    kv_gb: float               # all sequences' KV (and state) on this GPU at the target context
    reserve_gb: float
    capacity_gb: float

    @property
    def total_gb(self) -> float:
        return self.weights_gb + self.kv_gb + self.reserve_gb


def kv_gb(model: Model, context_tokens: int, share: float, concurrency: int) -> float:
    """concurrency x (kv_bytes_per_token x context + state_bytes_per_sequence) x share / 1e9.

    kv_bytes_per_token = attention layers x KV heads x head_dim x 2 x bytes + the profile's
    overhead (27B: 16 x 4 x 256 x 2 x 1 = 32 KiB + 12,805 B = 7.0 GB at 150K, docs/field-figures.md).
    """
    per_seq = model.kv_bytes_at(context_tokens) + model.state_bytes_per_sequence
    return concurrency * per_seq * share / 1e9


def memory_per_gpu(model: Model, lay: Layout, context_tokens: int, concurrency: int,
                   reserve_gb: float, capacity_gb: float) -> Memory:
    return Memory(lay.weights_gb_per_gpu, kv_gb(model, context_tokens, lay.kv_share, concurrency), reserve_gb, capacity_gb)


def max_context(model: Model, lay: Layout, concurrency: int, reserve_gb: float, capacity_gb: float) -> int:
    """min(native context, floor((capacity - weights - reserve - C x state x share) / (C x KV per token x share))), >= 0:
    engine.memory_fit's arithmetic, the one the engine's own default context runs."""
    free_bytes = memory_fit.free_for_context(capacity_gb * 1e9, lay.weights_gb_per_gpu * 1e9, reserve_gb * 1e9,
                                             model.state_bytes_per_sequence * lay.kv_share, concurrency)
    if free_bytes <= 0:
        return 0
    if model.window_tokens and model.window_layers:
        # Past the window only the full-attention layers (and the overhead) grow: solve the two pieces.
        scale = concurrency * lay.kv_share
        at_window = scale * model.kv_bytes_at(model.window_tokens)
        if free_bytes <= at_window:
            return min(model.native_context,
                       memory_fit.positions_that_fit(free_bytes, model.kv_bytes_per_token * lay.kv_share, concurrency))
        growth = scale * (model.kv_bytes_at(model.window_tokens + 1) - model.kv_bytes_at(model.window_tokens))
        if growth <= 0:
            return model.native_context
        return min(model.native_context, model.window_tokens + memory_fit.positions_that_fit(free_bytes - at_window, growth))
    return min(model.native_context,
               memory_fit.positions_that_fit(free_bytes, model.kv_bytes_per_token * lay.kv_share, concurrency))


def sequences_that_fit(model: Model, lay: Layout, context_tokens: int, reserve_gb: float, capacity_gb: float) -> int:
    """How many sequences of ``context_tokens`` each (their K/V and recurrent state) fit beside the weights and the
    reserve: the slots an engine that batches could serve at that context, >= 0."""
    per_seq_gb = kv_gb(model, context_tokens, lay.kv_share, 1)
    free_gb = capacity_gb - lay.weights_gb_per_gpu - reserve_gb
    if per_seq_gb <= 0:
        return 0
    return memory_fit.sequences_that_fit(free_gb, per_seq_gb)  # the service's default --max-concurrency too
