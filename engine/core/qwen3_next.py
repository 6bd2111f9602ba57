"""Qwen3-Next's fused Gated DeltaNet projections converted, at load, into the engine's layout (Qwen3.5's), so
the same kernels run both.

A Qwen3-Next checkpoint groups its linear-attention input projections per key head (transformers'
``fix_query_key_value_ordering``): with g = value heads / key heads,

  in_proj_qkvz  [key heads, (dk q | dk k | g dv v | g dv z)] rows
  in_proj_ba    [key heads, (g b | g a)] rows

while the engine's w_in rows are [all q | all k | all v | all z | all b | all a] (what Qwen3.5's separate
in_proj_qkv / z / b / a give). Key head j's value heads are j g .. (j + 1) g - 1 in both, and the conv1d and
the other per-head tensors are already in that order. A tensor-parallel rank's slice (whole key-head groups,
engine.core.tp) converts the same way with its own head counts.
"""

from __future__ import annotations

import torch


def split_qkvz(t: torch.Tensor, nk: int, nv: int, dk: int, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj_qkvz [nk (2 dk + 2 g dv), D] -> (in_proj_qkv [2 nk dk + nv dv, D], in_proj_z [nv dv, D])."""
    g = nv // nk
    rows = t.view(nk, 2 * dk + 2 * g * dv, -1)
    q, k, v, z = rows.split([dk, dk, g * dv, g * dv], dim=1)
    flat = [p.reshape(-1, t.shape[-1]) for p in (q, k, v, z)]
    return torch.cat(flat[:3]), flat[3]


def split_ba(t: torch.Tensor, nk: int, nv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj_ba [nk 2 g, D] -> (in_proj_b [nv, D], in_proj_a [nv, D])."""
    g = nv // nk
    b, a = t.view(nk, 2 * g, -1).split([g, g], dim=1)
    return b.reshape(nv, -1), a.reshape(nv, -1)


def convert(rest: str, t: torch.Tensor, layer) -> list[tuple[str, torch.Tensor]] | None:
    """The engine-layout (Qwen3.5) names and tensors of a layer's ``rest`` (a name within the layer), or None
    where nothing is converted. ``layer``: this rank's engine.core.model.Layer (its head counts)."""
    if rest == "linear_attn.in_proj_qkvz.weight":
        qkv, z = split_qkvz(t, layer.nk, layer.nv, layer.dk, layer.dv)
        return [("linear_attn.in_proj_qkv.weight", qkv), ("linear_attn.in_proj_z.weight", z)]
    if rest == "linear_attn.in_proj_ba.weight":
        b, a = split_ba(t, layer.nk, layer.nv)
        return [("linear_attn.in_proj_b.weight", b), ("linear_attn.in_proj_a.weight", a)]
    return None
