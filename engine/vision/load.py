"""The tower's weights from a checkpoint's ``model.visual.*`` tensors (dense bf16 / fp16 / fp32; a GPTQ / AWQ
checkpoint leaves its tower dense), memory-mapped, whole on every rank (replicated: engine.vision.tower)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.vision.config import VisionConfig
from engine.vision.tower import PREFIX, Tower, tensor_shapes


class TowerWeightsError(ValueError):
    """A checkpoint whose vision tensors do not fit its vision_config, with the reason."""


def checkpoint_dir(model_dir: str | Path) -> Path:
    """Where the tower's tensors are: the directory, or rank0/ of a `python -m engine shard` output (the shard
    keeps the tower whole in every rank directory only if it was written with it)."""
    d = Path(model_dir)
    return d / "rank0" if (d / "shard.json").exists() else d


def load_tower(model_dir: str | Path, cfg: VisionConfig, dtype: torch.dtype, device: str | torch.device) -> Tower:
    from safetensors import safe_open

    tower = Tower(cfg, dtype, device)
    want = tensor_shapes(cfg)
    seen: set[str] = set()
    d = checkpoint_dir(model_dir)
    for path in sorted(d.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if not name.startswith(PREFIX):
                    continue
                key = name[len(PREFIX):]
                if key not in want:
                    raise TowerWeightsError(f"{path.name}: tensor {name} has no place in the vision tower of "
                                            f"depth {cfg.depth}")
                t = f.get_tensor(name)
                if tuple(t.shape) != want[key]:
                    raise TowerWeightsError(f"{path.name}: {name} has shape {tuple(t.shape)}, the vision_config "
                                            f"gives {want[key]}")
                tower.w[key].copy_(t.to(dtype))
                seen.add(key)
    missing = sorted(set(want) - seen)
    if missing:
        raise TowerWeightsError(f"{d} lacks {len(missing)} vision tensor(s), e.g. {PREFIX}{missing[0]}: serve it "
                                "with --no-vision, or point --model at the unsharded checkpoint")
    return tower


def load_vision(model, model_dir: str | Path, cache_images: int = 8):
    """The rank's engine.vision.prompt.Vision for a loaded Model: the checkpoint's tower in the model's dtype on
    its device, the image rules; None for a text-only checkpoint."""
    from engine.vision import config as vconfig
    from engine.vision.prompt import Vision

    cfg = vconfig.load(model_dir)
    if cfg is None:
        return None
    if cfg.out_hidden_size != model.cfg.hidden_size:
        raise TowerWeightsError(f"the tower's out_hidden_size {cfg.out_hidden_size} is not the language model's "
                                f"hidden size {model.cfg.hidden_size}")
    tower = load_tower(model_dir, cfg, model.dtype, model.device)
    return Vision(model, tower, cfg, vconfig.image_rules(model_dir, cfg), cache_images)
