"""The config's layer types to their classes: adding a kind is one file in engine/model and one line here (and
its name in engine.core.config.LAYER_KINDS / MLP_KINDS, which the config is checked against)."""

from __future__ import annotations

import torch

from engine.core.config import ModelConfig
from engine.model.attention import FullAttention, GatedAttention
from engine.model.base import DenseMLP
from engine.model.gdn import GatedDeltaNet
from engine.model.moe import MoE

LAYER_KINDS = {
    "full_attention": FullAttention,
    "gated_attention": GatedAttention,  # full_attention where the config has attn_output_gate (Qwen3.5)
    "linear_attention": GatedDeltaNet,
}
MLP_KINDS = {"dense": DenseMLP, "moe": MoE}


def kind_of(cfg: ModelConfig, layer_type: str) -> str:
    return "gated_attention" if layer_type == "full_attention" and cfg.attn_output_gate else layer_type


def make_layer(cfg: ModelConfig, world: int, dtype: torch.dtype, device, layer_type: str, mlp: str = "dense"):
    """One decoder layer of this rank: the mixer of its kind, holding its MLP as ``.mlp``. A GPTQ / AWQ
    checkpoint's matrices are placed by the loader (engine.core.quant_load), so they start on the meta device."""
    e = dict(dtype=dtype, device=device)
    m = dict(dtype=dtype, device="meta") if cfg.quantization is not None else e
    layer = LAYER_KINDS[kind_of(cfg, layer_type)](cfg, world, e, m)
    layer.mlp = MLP_KINDS[mlp](cfg, world, e, m)
    return layer
