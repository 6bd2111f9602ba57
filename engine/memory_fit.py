"""What a context costs in memory and how many positions fit a card: the one piece of arithmetic the planner
(v100plan/planner: memory per GPU, max context) and the service's default context (engine/service/context_default.py)
both run. Stdlib only and importing nothing else of the engine, so the control plane imports it without torch.

  state of one sequence = K/V per position x positions + linear-attention (Gated DeltaNet) state
  K/V per position      = attention layers x KV heads x head_dim x 2 (K and V) x bytes per element
  bytes per element     = the element (int8: 1) + its share of a per-vector scale (int8: 4 bytes / head_dim)
  positions that fit    = floor((capacity - weights - runtime reserve - sequences x state) /
                                (sequences x K/V per position))
  sequences that fit    = floor((capacity - weights - runtime reserve) / (K/V per position x context + state))

The runtime reserve (CUDA context, allocator slack, prefix snapshots, prefill workspace) is a measured figure kept
in the bundled engine's profile (profiles/engines/v100plan.json, efficiency.runtime_reserve_gb, with its source);
runtime_reserve() reads it from there, so the planner and the engine use the same figure. docs/service.md,
"Default context", says where it was measured.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

GB = 1e9
# int8 K/V: one float32 scale per position and KV head, for K and for V (engine/core/kvquant.py)
INT8_SCALE_BYTES = 4.0
ENGINE_PROFILE = Path(__file__).resolve().parent.parent / "profiles" / "engines" / "v100plan.json"


def kv_element_bytes(element_bytes: float, scale_bytes_per_vector: float, head_dim: int) -> float:
    """Bytes per K or V element: the element plus its share of a scale kept per vector of ``head_dim`` values
    (int8 with a float32 scale, head_dim 256: 1 + 4 / 256 = 1.0156)."""
    return element_bytes + (scale_bytes_per_vector / head_dim if head_dim else 0.0)


def kv_bytes_per_position(attention_layers: int, kv_heads: float, head_dim: int, element_bytes: float) -> float:
    """attention layers x KV heads x head_dim x 2 (K and V) x bytes per element; linear-attention layers hold none.
    The 27B hybrid in bf16: 16 x 4 x 256 x 2 x 2 = 65,536 B a position (32 KiB on each of two ranks)."""
    return attention_layers * kv_heads * head_dim * 2 * element_bytes


def linear_state_bytes(layers: int, key_heads: float, value_heads: float, key_head_dim: int, value_head_dim: int,
                       conv_window: int, state_bytes_per_element: float = 4, conv_bytes_per_element: float = 2) -> float:
    """Gated DeltaNet state of one sequence over ``layers`` linear-attention layers:

    layers x (value heads x key dim x value dim x state bytes          (the recurrent state, fp32)
              + (2 x key heads x key dim + value heads x value dim)     (the q, k, v channels the conv sees)
                x conv window x conv bytes)                             (its rolling window, 16-bit)

    The 27B hybrid (window 3, the kernel less one): 48 x (48 x 128 x 128 x 4 + (2 x 16 x 128 + 48 x 128) x 3 x 2)
    = 153,944,064 B."""
    conv_channels = 2 * key_heads * key_head_dim + value_heads * value_head_dim
    return float(layers * (value_heads * key_head_dim * value_head_dim * state_bytes_per_element
                           + conv_channels * conv_window * conv_bytes_per_element))


def free_for_context(capacity_bytes: float, weights_bytes: float, reserve_bytes: float,
                     state_bytes: float = 0.0, sequences: int = 1) -> float:
    """Bytes left for K/V: capacity - weights - runtime reserve - sequences x fixed per-sequence state."""
    return capacity_bytes - weights_bytes - reserve_bytes - sequences * state_bytes


def positions_that_fit(free_bytes: float, bytes_per_position: float, sequences: int = 1) -> int:
    """floor(free bytes / (sequences x K/V per position)), 0 when nothing is free; a model without K/V (every layer
    linear attention) is never bounded by memory: a very large number then."""
    if free_bytes <= 0:
        return 0
    if bytes_per_position <= 0:
        return 1 << 62
    return math.floor(free_bytes / (sequences * bytes_per_position))


def sequences_that_fit(free_bytes: float, bytes_per_sequence: float) -> int:
    """floor(free bytes / bytes one sequence holds (its K/V at the context + its linear-attention state)), 0 when
    nothing is free; a sequence that holds nothing is never bounded by memory: a very large number then. The planner's
    breakdown.memory.sequences_that_fit and the service's default --max-concurrency both take it (any one unit)."""
    if free_bytes <= 0:
        return 0
    if bytes_per_sequence <= 0:
        return 1 << 62
    return max(0, int(free_bytes // bytes_per_sequence))


def runtime_reserve(profile: Path = ENGINE_PROFILE) -> tuple[float, str]:
    """(GB, source) of the bundled engine's runtime reserve per rank, from its profile. The profile ships with the
    engine (the deploy bundle carries profiles/); a missing or unreadable one raises ValueError with the path."""
    try:
        entry = json.loads(profile.read_text())["efficiency"]["runtime_reserve_gb"]
        return float(entry["value"]), str(entry["source"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{profile}: no efficiency.runtime_reserve_gb ({e}); the engine's profile ships with it "
                         "(profiles/engines/v100plan.json)") from None
