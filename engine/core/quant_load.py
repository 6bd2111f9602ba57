"""Loading a GPTQ / AWQ checkpoint's packed modules into a Model (engine.core.weights calls this).

Decided per module: one with ``qweight`` is quantised, one with ``weight`` dense (checkpoints mix them, e.g.
a dense o_proj beside packed MLPs). A model whose config has a quantization_config is built with its layer
matrices (wqkv, wo, w13, w2; a Gated DeltaNet layer's w_in, w_out) unallocated (on the meta device):
``Store.prepare`` allocates the dense ones the checkpoint holds, ``Store.finish`` puts a PackedLinear
(engine.core.quant) in place of the others, q/k/v and gate/up stacked along the output. A Gated DeltaNet layer's
w_in (in_proj_qkv | z | b | a) may mix them: its dense modules (usually the small b and a) are read by the Store
too, and w_in becomes a quant.Rows (packed parts beside dense ones) where one PackedLinear cannot hold it all.
Nothing is dequantised.
"""

from __future__ import annotations

import re

import torch

from engine.core import quant, tp

_PROJ = r"^((?:model|mtp)\.layers)\.(\d+)\.((?:self_attn|mlp)\.\w+_proj|linear_attn\.(?:in_proj_\w+|out_proj))\."
_MODULE = re.compile(_PROJ + r"(qweight|qzeros|scales|g_idx)$")
_PART = re.compile(_PROJ + r"(qweight|qzeros|scales|g_idx|weight)$")
# the layer matrix each checkpoint module lands in, in the order they are stacked
MATRICES = {"wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "wo": ("self_attn.o_proj",),
            "w13": ("mlp.gate_proj", "mlp.up_proj"), "w2": ("mlp.down_proj",),
            "w_in": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                     "linear_attn.in_proj_a"), "w_out": ("linear_attn.out_proj",)}
MIXABLE = ("w_in",)  # packed and dense modules may share this matrix (a quant.Rows)


def _layer_lists(m) -> list[tuple[str, list]]:
    """The decoder's layers and the MTP draft layers (Qwen3.5), each with its checkpoint prefix."""
    out = [("model.layers", m.layers)]
    if m.mtp is not None:
        out.append(("mtp.layers", m.mtp.layers))
    return out


def packed_part(name: str) -> bool:
    return bool(_MODULE.match(name))


def layer_inputs(cfg, names: set[str] | frozenset = frozenset()) -> dict[str, int]:
    """Each matrix's input size, row-parallel ones marked (quant.check_inputs); a Gated DeltaNet layer's
    projections where the checkpoint's tensor ``names`` hold them packed."""
    out = {"q/k/v_proj": cfg.hidden_size, "gate/up_proj": cfg.hidden_size,
           "rowwise:o_proj": cfg.num_heads * cfg.head_dim, "rowwise:down_proj": cfg.intermediate_size}
    if any(".linear_attn.in_proj_" in n and n.endswith(".qweight") for n in names):
        out["in_proj"] = cfg.hidden_size
    if any(".linear_attn.out_proj.qweight" in n for n in names):
        out["rowwise:out_proj"] = cfg.linear_value_dim
    return out


class Store:
    """The packed tensors of one rank while a checkpoint is read."""

    def __init__(self, model, qcfg: quant.QuantConfig):
        self.model, self.q = model, qcfg
        self.parts: dict[tuple[str, int, str], dict[str, torch.Tensor]] = {}
        self.routed: set[str] = set()  # dense modules' weights stacked with packed ones: read here too
        quant.check_inputs(qcfg, layer_inputs(model.cfg), model.world)

    def takes(self, name: str) -> bool:
        """Whether this checkpoint tensor is the Store's to read (packed parts, dense partners of packed ones)."""
        return packed_part(name) or name in self.routed

    def prepare(self, names: set[str]) -> None:
        """Allocate the dense matrices the checkpoint holds; refuse a fused matrix half packed, half dense."""
        for bad in ("model.embed_tokens.qweight", "lm_head.qweight"):
            if bad in names:
                raise quant.QuantError(f"{bad}: a quantised embedding or output head is not supported")
        m = self.model
        quant.check_inputs(self.q, layer_inputs(m.cfg, names), m.world)
        for prefix, layers in _layer_lists(m):
            for i, layer in enumerate(layers):
                for attr, modules in MATRICES.items():
                    blk = layer.owner(attr)  # the mixer, or its MLP (w13, w2)
                    if not hasattr(blk, attr):  # a linear-attention layer has no wqkv / wo
                        continue
                    packed = [f"{prefix}.{i}.{mod}.qweight" in names for mod in modules]
                    dense = [f"{prefix}.{i}.{mod}.weight" in names for mod in modules]
                    missing = [mod for mod, p, d in zip(modules, packed, dense) if not p and not d]
                    if any(packed) and missing:
                        raise quant.QuantError(f"{prefix}.{i}.{missing[0]}: neither qweight nor weight (it is "
                                               f"stacked with packed modules into one matrix)")
                    if any(packed) and any(dense):
                        if attr not in MIXABLE:
                            raise quant.QuantError(f"{prefix}.{i}: {', '.join(modules)} are stacked into one matrix "
                                                   f"and must be all quantised or all dense")
                        self.routed.update(f"{prefix}.{i}.{mod}.weight" for mod, d in zip(modules, dense) if d)
                    t = getattr(blk, attr)
                    if not any(packed) and isinstance(t, torch.Tensor) and t.is_meta:
                        setattr(blk, attr, torch.empty(t.shape, dtype=m.dtype, device=m.device))

    def add(self, name: str, source, pre_sliced: bool) -> None:
        prefix, layer, module, part = _PART.match(name).groups()
        m = self.model
        t = source[:] if pre_sliced else tp.take(source, tp.kind_of(name), m.rank, m.world, m.cfg, name=name)
        self.parts.setdefault((prefix, int(layer), module), {})[part] = t

    def finish(self) -> None:
        m = self.model
        for prefix, layers in _layer_lists(m):
            for i, layer in enumerate(layers):
                for attr, modules in MATRICES.items():
                    blk = layer.owner(attr)
                    if hasattr(blk, attr) and any((prefix, i, mod) in self.parts for mod in modules):
                        setattr(blk, attr, self._built(prefix, i, attr, modules, getattr(blk, attr).shape))
        if self.parts:
            raise quant.QuantError(f"packed tensors with no place in this model: {sorted(self.parts)[:3]}")

    def _built(self, prefix: str, i: int, attr: str, modules: tuple[str, ...], want) -> object:
        """Layer i's matrix ``attr`` from its modules' parts: packed ones as PackedLinear, dense partners as read."""
        m = self.model
        built = []
        for mod in modules:
            parts = self.parts.pop((prefix, i, mod), None)
            if parts is None:
                raise quant.QuantError(f"{prefix}.{i}.{mod}: no qweight (its fused partners have one)")
            if "weight" in parts:  # a dense partner of packed modules
                built.append(parts["weight"].to(dtype=m.dtype, device=m.device))
                continue
            rowwise = tp.kind_of(f"{prefix}.{i}.{mod}.weight") == "rowwise"
            offset = m.rank * parts["scales"].shape[0] if rowwise and m.world > 1 else 0
            built.append(quant.from_checkpoint(self.q, parts, f"{prefix}.{i}.{mod}", offset).to(m.device))
        w = quant.stack(built)
        if w.shape != tuple(want):
            raise quant.QuantError(f"{prefix}.{i} {attr}: packed shape {w.shape} does not fit {tuple(want)} (rank "
                                   f"{m.rank} of {m.world})")
        from engine.kernels import gemv_int4

        return gemv_int4.held(w, m.device)  # fused in rows above, then held as the card's GEMV reads it
