"""Decode: the time of one round and the tokens it yields.

round = weight bytes read / (bandwidth x weight_bw_fraction)
      + KV bytes read at the context / (bandwidth x kv_bw_fraction)
      + round overhead (slowed by a throttling pair's clock ratio)
        = round_overhead_ms + round_overhead_per_layer_ms x the model's layers (round_overhead_ms)
      + allreduces per round x one allreduce + hand-overs between cards
      + k draft steps (a separate draft model or an MTP head: its bytes / (bandwidth x weight fraction),
        plus the engine's round overhead for a separate draft model)
      where the weight read is at least the time to compute the k + 1 verified tokens
      (k + 1) x matrix FLOPs per token / (tensor peak x prefill_compute_fraction)
tokens per round = (1 - a^(k+1)) / (1 - a)     (k drafts, per-token acceptance a: the expected accepted
                                                 prefix plus the token the verification yields)
                 = 1 + k x A                   (engines whose A is the share of drafts accepted, docs/field-figures.md)
ceiling          = tokens per round / (bytes read per round / bandwidth): no overhead, 100 % bandwidth

Under tp2 each card reads its shard and its half of the KV heads with half-width kernels, which
run less efficiently than full-width ones: the round then divides by the engine's
tp2_weight_bw_fraction and tp2_kv_bw_fraction where the profile has them (Engine.decode_fractions).
Sources: docs/field-figures.md, half-width V100 matrix kernels take 0.51-0.61 of the full-width time (not 0.50);
two H200s (tests/fixtures/multigpu, 2026-11-29), a rank's K/V reads ran at 1.07 TB/s under TP2 vs
1.72 at TP1. Without them the one-card fractions stand in and the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Round:
    weights_ms: float
    kv_ms: float
    overhead_ms: float
    allreduce_ms: float
    hops_ms: float
    ceiling_ms: float
    tokens_per_round: float
    draft_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        return self.weights_ms + self.kv_ms + self.overhead_ms + self.allreduce_ms + self.hops_ms + self.draft_ms

    @property
    def tok_s(self) -> float:
        return self.tokens_per_round / self.total_ms * 1e3

    @property
    def ceiling_tok_s(self) -> float:
        return self.tokens_per_round / self.ceiling_ms * 1e3


def tokens_per_round(draft_tokens: int, acceptance: float, definition: str = "accepted_share") -> float:
    """Expected tokens one round yields with k drafts.

    "per_token": the standard formula for per-token acceptance a (draft i is kept only if drafts
    1..i-1 were): 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a) (Leviathan et al., speculative
    decoding); a = 1 gives k + 1.
    "accepted_share": 1 + k x A, where A is the share of drafted tokens accepted, as the field report
    measures it (docs/field-figures.md).
    """
    k, a = draft_tokens, acceptance
    if definition == "per_token":
        if k <= 0:
            return 1.0
        if a >= 1.0:
            return float(k + 1)
        return (1.0 - a ** (k + 1)) / (1.0 - a)
    return 1.0 + k * a


def round_overhead_ms(constant_ms: float, per_layer_ms: float | None, layers: int) -> float:
    """constant_ms + per_layer_ms x layers: what a round costs beyond its reads.

    The per-layer part is for engines whose fixed cost is the same handful of small kernels per layer
    (norms, rotary, attention, activation, the gaps between launches) whatever the layer's width: it
    grows with the layer count and is NOT divided by tensor parallel (each rank runs every layer at a
    narrower width) nor by pipeline stages (the stages run their layers one after another, so a round
    still pays for every layer). Source: the bundled engine's H200 profile, docs/engine-speed.md
    (~14 small kernels a layer; they did not shrink at half width under TP2)."""
    return constant_ms + (per_layer_ms or 0.0) * layers


def read_ms(gb: float, bw_gbps: float, fraction: float = 1.0) -> float:
    """gb / (bw_gbps x fraction) in milliseconds (GB = 1e9 bytes, GB/s = 1e9 bytes/s)."""
    return gb / (bw_gbps * fraction) * 1e3


def decode_round(weights_gb: float, kv_gb: float, bw_gbps: float, weight_fraction: float, kv_fraction: float,
                 overhead_ms: float, clock_ratio: float, allreduce_ms: float, hops_ms: float, tpr: float,
                 draft_ms: float = 0.0, verify_compute_ms: float = 0.0) -> Round:
    """One decode round (module docstring). ``clock_ratio`` <= 1 stretches only the overhead:
    weight and KV reads are bandwidth-bound and a hot card's memory clock does not drop.
    ``verify_compute_ms``: the matrix compute of the verified tokens, which the weight read hides
    unless it is longer."""
    return Round(
        weights_ms=max(read_ms(weights_gb, bw_gbps, weight_fraction), verify_compute_ms),
        kv_ms=read_ms(kv_gb, bw_gbps, kv_fraction),
        overhead_ms=overhead_ms / clock_ratio,
        allreduce_ms=allreduce_ms, hops_ms=hops_ms,
        ceiling_ms=read_ms(weights_gb + kv_gb, bw_gbps),
        tokens_per_round=tpr, draft_ms=draft_ms,
    )


def compute_scaled_fraction(fraction: float, bw_ratio: float, compute_ratio: float) -> float:
    """A read fraction calibrated on one card, carried to another card of the same generation.

    A read at fraction f takes bytes / (B_ref x f) on the calibration card: bytes / B_ref at full bandwidth plus
    bytes / B_ref x (1 / f - 1) lost to instruction issue and latency, which scale with the card's compute
    (SMs x SM clock), not its memory. On a card with bandwidth B = bw_ratio x B_ref and compute_ratio x the
    calibration card's compute, the same read takes bytes / B + bytes / B_ref x (1 / f - 1) / compute_ratio, i.e.

        f' = 1 / (1 + bw_ratio x (1 / f - 1) / compute_ratio)

    f' = f on the calibration card itself. Why: the field measured its two V100 pairs within 3 % of each other
    at 186K (docs/field-figures.md) although one has 20 % more bandwidth and the other 23 % more compute."""
    if fraction <= 0 or bw_ratio <= 0 or compute_ratio <= 0:
        return fraction
    return 1.0 / (1.0 + bw_ratio * (1.0 / fraction - 1.0) / compute_ratio)
