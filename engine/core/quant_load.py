"""Loading a GPTQ / AWQ checkpoint's packed modules into a Model (engine.core.weights calls this).

Decided per module: one with ``qweight`` is quantised, one with ``weight`` dense (checkpoints mix them, e.g.
a dense o_proj beside packed MLPs). A model whose config has a quantization_config is built with its four
layer matrices (wqkv, wo, w13, w2) unallocated (on the meta device): ``Store.prepare`` allocates the dense
ones the checkpoint holds, ``Store.finish`` puts a PackedLinear (engine.core.quant) in place of the others,
q/k/v and gate/up stacked along the output. Nothing is dequantised.
"""

from __future__ import annotations

import re

import torch

from engine.core import quant, tp

_MODULE = re.compile(r"^model\.layers\.(\d+)\.((?:self_attn|mlp)\.\w+_proj)\.(qweight|qzeros|scales|g_idx)$")
# the layer matrix each checkpoint module lands in, in the order they are stacked
MATRICES = {"wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "wo": ("self_attn.o_proj",),
            "w13": ("mlp.gate_proj", "mlp.up_proj"), "w2": ("mlp.down_proj",)}


def packed_part(name: str) -> bool:
    return bool(_MODULE.match(name))


def layer_inputs(cfg) -> dict[str, int]:
    """Each matrix's input size, row-parallel ones marked (quant.check_inputs)."""
    return {"q/k/v_proj": cfg.hidden_size, "gate/up_proj": cfg.hidden_size,
            "rowwise:o_proj": cfg.num_heads * cfg.head_dim, "rowwise:down_proj": cfg.intermediate_size}


class Store:
    """The packed tensors of one rank while a checkpoint is read."""

    def __init__(self, model, qcfg: quant.QuantConfig):
        self.model, self.q = model, qcfg
        self.parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        quant.check_inputs(qcfg, layer_inputs(model.cfg), model.world)

    def prepare(self, names: set[str]) -> None:
        """Allocate the dense matrices the checkpoint holds; refuse a fused matrix half packed, half dense."""
        for bad in ("model.embed_tokens.qweight", "lm_head.qweight"):
            if bad in names:
                raise quant.QuantError(f"{bad}: a quantised embedding or output head is not supported")
        gdn = sorted(n for n in names if ".linear_attn." in n and n.endswith(".qweight"))
        if gdn:
            raise quant.QuantError(f"{gdn[0]}: packed Gated DeltaNet projections are not supported (their MLPs and "
                                   f"full-attention layers may be packed, the linear_attn weights must be dense)")
        m = self.model
        for i, layer in enumerate(m.layers):
            for attr, modules in MATRICES.items():
                if not hasattr(layer, attr):  # a linear-attention layer has no wqkv / wo
                    continue
                packed = [f"model.layers.{i}.{mod}.qweight" in names for mod in modules]
                dense = [f"model.layers.{i}.{mod}.weight" in names for mod in modules]
                if any(packed) and not all(packed) or any(packed) and any(dense):
                    raise quant.QuantError(f"layer {i}: {', '.join(modules)} are stacked into one matrix and must be "
                                           f"all quantised or all dense")
                t = getattr(layer, attr)
                if not any(packed) and isinstance(t, torch.Tensor) and t.is_meta:
                    setattr(layer, attr, torch.empty(t.shape, dtype=m.dtype, device=m.device))

    def add(self, name: str, source, pre_sliced: bool) -> None:
        layer, module, part = _MODULE.match(name).groups()
        kind = tp.kind_of(name)
        t = source[:] if pre_sliced else tp.take(source, kind, self.model.rank, self.model.world, name=name)
        self.parts.setdefault((int(layer), module), {})[part] = t

    def finish(self) -> None:
        m = self.model
        for i, layer in enumerate(m.layers):
            for attr, modules in MATRICES.items():
                if (i, modules[0]) not in self.parts or not hasattr(layer, attr):
                    continue
                built = []
                for mod in modules:
                    parts = self.parts.pop((i, mod), None)
                    if parts is None:
                        raise quant.QuantError(f"model.layers.{i}.{mod}: no qweight (its fused partners have one)")
                    rowwise = tp.kind_of(f"model.layers.{i}.{mod}.weight") == "rowwise"
                    offset = m.rank * parts["scales"].shape[0] if rowwise and m.world > 1 else 0
                    built.append(quant.from_checkpoint(self.q, parts, f"model.layers.{i}.{mod}", offset))
                w = quant.cat(built) if len(built) > 1 else built[0]
                want = tuple(getattr(layer, attr).shape)
                if w.shape != want:
                    raise quant.QuantError(f"layer {i} {attr}: packed shape {w.shape} does not fit {want} (rank "
                                           f"{m.rank} of {m.world})")
                setattr(layer, attr, w.to(m.device))
        if self.parts:
            raise quant.QuantError(f"packed tensors with no place in this model: {sorted(self.parts)[:3]}")
