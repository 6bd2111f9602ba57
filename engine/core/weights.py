"""Loading a Hugging Face checkpoint (or one rank's shard of it) into a Model, memory-mapped.

With world > 1 an unsharded checkpoint is sliced at load: safetensors reads only
this rank's rows or columns from the mapped file, so a rank never holds the
whole model in memory. A directory written by ``python -m engine shard`` holds
``shard.json`` and ``rank0/``, ``rank1/``: each rank reads its own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from engine.core import tp
from engine.core.model import Model

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")  # Qwen3-Next's routed experts
MTP_TOP = {"mtp.fc.weight": "fc", "mtp.pre_fc_norm_embedding.weight": "emb_norm",
           "mtp.pre_fc_norm_hidden.weight": "hid_norm", "mtp.norm.weight": "norm"}


class WeightsError(ValueError):
    """A checkpoint that does not fit the config, with the reason."""


def safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors files in {model_dir}")
    return files


def resolve(model_dir: str | Path, rank: int, world: int) -> tuple[Path, bool]:
    """(directory to read this rank's tensors from, whether they are already sliced)."""
    d = Path(model_dir)
    manifest = d / "shard.json"
    if manifest.exists():
        tp_size = json.loads(manifest.read_text())["tp"]
        if tp_size != world:
            raise WeightsError(f"{d} is sharded for tp {tp_size}, but this run uses {world} rank(s)")
        return d / f"rank{rank}", True
    return d, False


def _slot(model: Model, name: str) -> tuple[torch.Tensor, int]:
    """The model tensor a checkpoint tensor lands in, and the row offset within it (fused q/k/v, gate/up)."""
    if name == "model.embed_tokens.weight":
        return model.embed, 0
    if name == "lm_head.weight":
        return model.head, 0
    if name == "model.norm.weight":
        return model.norm, 0
    if name.startswith("mtp.") and model.mtp is not None:  # the draft layer: its own norms and fc, then layers
        if name in MTP_TOP:
            return getattr(model.mtp, MTP_TOP[name]), 0
        m = _MTP_LAYER.match(name)
        if not m or int(m.group(1)) >= len(model.mtp.layers):
            raise WeightsError(f"unexpected tensor {name} (the config declares {len(model.mtp.layers)} MTP layer(s))")
        return _layer_slot(model, model.mtp.layers[int(m.group(1))], m.group(2), name)
    m = _LAYER.match(name)
    if not m or int(m.group(1)) >= len(model.layers):
        raise WeightsError(f"unexpected tensor {name}")
    return _layer_slot(model, model.layers[int(m.group(1))], m.group(2), name)


def _layer_slot(model: Model, layer, rest: str, name: str) -> tuple:
    if layer.mlp.kind == "moe":
        return _moe_slot(layer.mlp, rest, name) or _mixer_slot(model, layer, rest, name)
    return _mixer_slot(model, layer, rest, name)


def _moe_slot(layer, rest: str, name: str) -> tuple | None:
    """(tensor, row offset, expert index or None) of a MoE MLP's tensor (engine.core.moe), None for another."""
    table = {"mlp.gate.weight": (layer.router, 0, None), "mlp.shared_expert_gate.weight": (layer.shared_gate, 0, None),
             "mlp.shared_expert.gate_proj.weight": (layer.w13, 0, None),
             "mlp.shared_expert.up_proj.weight": (layer.w13, layer.ff, None),
             "mlp.shared_expert.down_proj.weight": (layer.w2, 0, None)}
    if rest in table:
        return table[rest]
    m = _EXPERT.match(rest)
    if m is None:
        if rest.startswith("mlp."):
            raise WeightsError(f"tensor {name} has no place in a MoE layer (router mlp.gate, mlp.experts.E.*, "
                               f"mlp.shared_expert.*, mlp.shared_expert_gate)")
        return None
    e, part = int(m.group(1)), m.group(2)
    if e >= layer.ew13.shape[0]:
        raise WeightsError(f"tensor {name}: expert {e} of num_experts = {layer.ew13.shape[0]}")
    if part == "down":
        return layer.ew2, 0, e
    return layer.ew13, 0 if part == "gate" else layer.ew13.shape[1] // 2, e


def _mixer_slot(model: Model, layer, rest: str, name: str) -> tuple[torch.Tensor, int]:
    mlp = layer.mlp
    common = {
        "input_layernorm.weight": (layer.input_norm, 0),
        "post_attention_layernorm.weight": (mlp.post_norm, 0),
        "mlp.gate_proj.weight": (mlp.w13, 0),
        "mlp.up_proj.weight": (mlp.w13, mlp.ff),
        "mlp.gate_proj.bias": (mlp.b13, 0),
        "mlp.up_proj.bias": (mlp.b13, mlp.ff),
        "mlp.down_proj.weight": (mlp.w2, 0),
        "mlp.down_proj.bias": (mlp.b2, 0),
    }
    if layer.kind == "linear_attention":
        vd = layer.nv * layer.dv
        table = {
            **common,
            "linear_attn.in_proj_qkv.weight": (layer.w_in, 0),
            "linear_attn.in_proj_z.weight": (layer.w_in, layer.conv_channels),
            "linear_attn.in_proj_b.weight": (layer.w_in, layer.conv_channels + vd),
            "linear_attn.in_proj_a.weight": (layer.w_in, layer.conv_channels + vd + layer.nv),
            "linear_attn.conv1d.weight": (layer.conv_w, 0),
            "linear_attn.A_log": (layer.a_log, 0),
            "linear_attn.dt_bias": (layer.dt_bias, 0),
            "linear_attn.norm.weight": (layer.gnorm, 0),
            "linear_attn.out_proj.weight": (layer.w_out, 0),
        }
        if rest not in table:
            raise WeightsError(f"tensor {name} has no place in a linear-attention layer (the config's layer_types)")
        return table[rest]
    qn, kvn = layer.q_rows, layer.n_kv * layer.hd
    table = {
        **common,
        "self_attn.q_proj.weight": (layer.wqkv, 0),
        "self_attn.k_proj.weight": (layer.wqkv, qn),
        "self_attn.v_proj.weight": (layer.wqkv, qn + kvn),
        "self_attn.q_proj.bias": (layer.bqkv, 0),
        "self_attn.k_proj.bias": (layer.bqkv, qn),
        "self_attn.v_proj.bias": (layer.bqkv, qn + kvn),
        "self_attn.o_proj.weight": (layer.wo, 0),
        "self_attn.o_proj.bias": (layer.bo, 0),
        "self_attn.q_norm.weight": (layer.q_norm, 0),
        "self_attn.k_norm.weight": (layer.k_norm, 0),
    }
    if rest not in table or table[rest][0] is None:
        raise WeightsError(f"tensor {name} has no place in a {model.cfg.model_type} model with this config")
    return table[rest]


def _place(model: Model, name: str, t: torch.Tensor, filled: dict[int, int]) -> None:
    from engine.core import qwen3_next

    m = _LAYER.match(name)
    if m and int(m.group(1)) < len(model.layers):  # Qwen3-Next's fused projections: the engine's layout first
        parts = qwen3_next.convert(m.group(2), t, model.layers[int(m.group(1))])
        if parts is not None:
            for rest, part in parts:
                _place(model, f"model.layers.{m.group(1)}.{rest}", part, filled)
            return
    dest, off, *expert = _slot(model, name)
    if dest.dim() == 2 and t.dim() == 3 and t.shape[1] == 1:  # conv1d [channels, 1, kernel] -> [channels, kernel]
        t = t[:, 0]
    n = t.shape[0]
    target = dest[off:off + n] if not expert or expert[0] is None else dest[expert[0], off:off + n]
    if tuple(target.shape) != tuple(t.shape):
        raise WeightsError(f"{name}: checkpoint shape {tuple(t.shape)} does not fit {tuple(target.shape)} "
                           f"(rank {model.rank} of {model.world})")
    target.copy_(t.to(dtype=model.dtype))
    filled[id(dest)] = filled.get(id(dest), 0) + t.numel()


@torch.inference_mode()
def load_into(model: Model, model_dir: str | Path) -> None:
    """Fill every weight of ``model`` from the checkpoint; WeightsError naming anything missing or extra."""
    from safetensors import safe_open

    from engine.core import random_weights

    src, pre_sliced = resolve(model_dir, model.rank, model.world)
    attach(model)
    cfg = model.cfg
    filled: dict[int, int] = {}
    names: set[str] = set()
    if random_weights.is_random(src):  # weights generated on the card (engine.core.random_weights)
        if cfg.quantization is not None:
            raise WeightsError(f"{src}: a random-weights model is dense, but its config has quantization_config")
        try:
            names = random_weights.load(model, src, lambda n, t: _place(model, n, t, filled))
        except ValueError as e:
            raise WeightsError(str(e)) from None
        model.weights_origin = "random"
        _check_filled(model, src, filled)
        return
    store = None
    if cfg.quantization is not None:  # GPTQ / AWQ: packed modules go to engine.core.quant_load
        from engine.core import quant_load

        store = quant_load.Store(model, cfg.quantization)
        store.prepare({tp.canonical(n, cfg) for path in safetensors_files(src) for n in _keys(path)})
    for path in safetensors_files(src):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            raw = {tp.canonical(n, cfg): n for n in f.keys() if not tp.IGNORED.search(n)
                   and not (n.startswith("mtp.") and model.mtp is None)}  # a draft layer the config does not run
            for name, stored in raw.items():
                if store is not None and store.takes(name):
                    store.add(name, f.get_slice(stored), pre_sliced)
                    names.add(name)
                    continue
                kind = tp.kind_of(name)
                names.add(name)
                if pre_sliced:
                    t = f.get_tensor(stored)
                else:
                    t = tp.take(f.get_slice(stored), kind, model.rank, model.world, cfg)
                _place(model, name, t, filled)
            if "lm_head.weight" not in names and "model.embed_tokens.weight" in raw and not pre_sliced:
                if model.cfg.tie_word_embeddings:
                    t = tp.take(f.get_slice(raw["model.embed_tokens.weight"]), "vocab", model.rank, model.world)
                    _place(model, "lm_head.weight", t, filled)
                    names.add("lm_head.weight")
    if "lm_head.weight" not in names:
        raise WeightsError("no lm_head.weight and the config does not tie it to the embeddings")
    if store is not None:
        store.finish()
    if model.mtp is not None and not any(n.startswith("mtp.") for n in names):
        model.mtp = None  # the config declares a draft layer the checkpoint does not carry: nothing to draft with
    _check_filled(model, src, filled)


def _check_filled(model: Model, src: Path, filled: dict[int, int]) -> None:
    for label, t in expected_tensors(model):
        if filled.get(id(t), 0) != t.numel():
            raise WeightsError(f"checkpoint in {src} does not fill {label} ({filled.get(id(t), 0)} of "
                               f"{t.numel()} values)")


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        return list(f.keys())


def expected_tensors(model: Model) -> list[tuple[str, torch.Tensor]]:
    out = [("embed", model.embed), ("head", model.head), ("norm", model.norm)]
    for i, layer in enumerate(model.layers):
        for k, t in layer.weights().items():
            out.append((f"layers.{i}.{k}", t))
    if model.mtp is not None:
        out += [(f"mtp.{k}", t) for k, t in model.mtp.weights()]
    return out


def attach(model: Model) -> None:
    """What the loader adds to a model built from its config: the MTP draft layer (engine.model.mtp) where the
    config declares one, and the prefill's kernel choice for the model's device (the Decoder sets it again)."""
    if model.cfg.mtp_layers and model.mtp is None:
        from engine.model.mtp import MTP

        model.mtp = MTP(model.cfg, model.world, model.dtype, model.device)
        for layer in model.mtp.layers if model.max_context else ():  # a model whose cache is already set up
            layer.alloc_state(model.slots, model.max_context, model.dtype, model.device, model.kv_int8)
    if model.kernels is None:
        from engine.core.device import device_kernels

        model.kernels = device_kernels(model.device)[0]


@torch.inference_mode()
def init_random(model: Model, seed: int = 0, std: float = 0.02) -> None:
    """Random weights generated where the model lives (the benchmark: shapes and bytes are what matter)."""
    attach(model)
    g = torch.Generator(device=model.device).manual_seed(seed)
    for label, t in expected_tensors(model):
        if label.endswith(".a_log"):  # decay rates as Qwen3.5 initialises them: A in [1, 16], log stored
            t.uniform_(0.0, 2.77, generator=g)
        elif label.endswith(".dt_bias"):
            t.fill_(1.0)
        elif label.endswith(".gnorm"):
            t.fill_(1.0)
        elif t.dim() == 1 and "norm" in label:
            t.fill_(0.0 if model.zc else 1.0)  # zero-centred norms apply 1 + w
        elif t.dim() == 1:
            t.zero_()
        else:
            t.normal_(0.0, std, generator=g)
