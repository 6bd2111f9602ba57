"""Prefill: time to first token for a prompt of the target length from an empty cache.

FLOPs = matrix FLOPs per token x T  +  2 x attention layers x q heads x head_dim x T^2
        (causal QK^T and PV; linear-attention layers add no quadratic term)
time  = matrix FLOPs / (tensor peak x prefill_compute_fraction x clock ratio) / tp
      + attention FLOPs / (tensor peak x prefill_attention_fraction x clock ratio) / tp
      + chunks x allreduces per chunk x one chunk-sized allreduce          (tp2 only)
docs/field-figures.md: prefill is compute-bound; 186K took 379 s on one V100 and 249 s on the PCIe TP2 pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from v100plan.planner.inputs import Model


@dataclass(frozen=True)
class Prefill:
    matrix_s: float
    attention_s: float
    comm_s: float

    @property
    def total_s(self) -> float:
        return self.matrix_s + self.attention_s + self.comm_s


def matrix_flops(model: Model, tokens: int) -> float:
    """matrix_flops_per_token x tokens (27B: 2 x 27e9 per token, docs/field-figures.md)."""
    return model.matrix_flops_per_token * tokens


def attention_flops(model: Model, tokens: int) -> float:
    """2 x attention layers x q heads x head_dim x tokens^2 (causal: half of 4 x h x d x T^2)."""
    return 2.0 * model.attention_layers * model.q_heads * model.head_dim * tokens * tokens


def chunks(tokens: int, chunk_tokens: int) -> int:
    return math.ceil(tokens / chunk_tokens)


def prefill_time(model: Model, tokens: int, peak_tflops: float, compute_fraction: float, attention_fraction: float,
                 clock_ratio: float, tp: int, comm_s: float) -> Prefill:
    rate = peak_tflops * 1e12 * clock_ratio
    return Prefill(
        matrix_s=matrix_flops(model, tokens) / (rate * compute_fraction) / tp,
        attention_s=attention_flops(model, tokens) / (rate * attention_fraction) / tp,
        comm_s=comm_s,
    )
