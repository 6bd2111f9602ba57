"""The vision tower's shape and the image rules, as plain data read from a Qwen3.5 multimodal checkpoint:
config.json's ``vision_config`` (the tower), its image token ids, the text config's ``mrope_section`` (how the
language model's rotary frequencies are shared between the time, height and width of an image token), and
preprocessor_config.json (resize limits, patch sizes, mean and std; Qwen2-VL's processor rules, which the
Qwen3.5 family uses)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# The processor's defaults where a checkpoint has no preprocessor_config.json: Qwen3-VL / Qwen3.5's published
# values (64K to 16M pixels, mean and std 0.5), with the tower's patch sizes.
MIN_PIXELS = 65536
MAX_PIXELS = 16777216
MEAN_STD = (0.5, 0.5, 0.5)
MROPE_SECTION = (11, 11, 10)  # transformers' default for Qwen3.5 (t, h, w frequencies of the 32 in the 27B's head)
ACTS = ("gelu_pytorch_tanh", "gelu")


class VisionConfigError(ValueError):
    """A vision_config or preprocessor_config.json this engine cannot run, with the reason."""


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int  # the language model's hidden size: the merger's output
    num_position_embeddings: int  # a square grid of learned positions, resampled to each image's grid
    hidden_act: str
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: tuple[int, int, int]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch: channels x temporal patch x patch x patch (a still image is repeated in time)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    def param_count(self) -> int:
        """Every tower weight: patch embedding, learned positions, blocks (two LayerNorms, qkv, proj, MLP; all
        with biases), the merger (LayerNorm, two linears over merge_unit patches)."""
        d, f, m = self.hidden_size, self.intermediate_size, self.merge_unit * self.hidden_size
        block = 4 * d + 3 * d * d + 3 * d + d * d + d + d * f + f + f * d + d
        merger = 2 * d + m * m + m + m * self.out_hidden_size + self.out_hidden_size
        return (self.patch_dim * d + d + self.num_position_embeddings * d + self.depth * block + merger)

    def flops(self, patches: int) -> int:
        """Matrix FLOPs of one image of ``patches`` patches (one attention sequence): 2 x weights x patches for
        the linear layers, 4 x patches^2 x hidden for the attention's two products."""
        d, f, m = self.hidden_size, self.intermediate_size, self.merge_unit * self.hidden_size
        per_patch = self.patch_dim * d + self.depth * (4 * d * d + 2 * d * f)
        merged = patches // self.merge_unit
        return 2 * patches * per_patch + self.depth * 4 * patches * patches * d + 2 * merged * (m * m + m * self.out_hidden_size)


@dataclasses.dataclass(frozen=True)
class ImageRules:
    """Qwen2-VL's processor rules: resize to multiples of patch x merge within [min_pixels, max_pixels]
    (smart_resize), rescale to [0, 1], normalise, cut into patches."""
    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float = 1 / 255
    resample: int = 3  # PIL's BICUBIC, the processor's default

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def from_dict(raw: dict[str, Any]) -> VisionConfig | None:
    """The tower of a multimodal config.json (model_type qwen3_5 with a vision_config), None for a text-only one."""
    vc = raw.get("vision_config")
    if not isinstance(vc, dict):
        return None
    if raw.get("model_type") not in ("qwen3_5",):
        raise VisionConfigError(f"a vision_config under model_type {raw.get('model_type')!r}: this engine runs the "
                                "vision tower of qwen3_5 checkpoints")
    text = raw.get("text_config") or {}
    act = vc.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACTS:
        raise VisionConfigError(f"vision_config.hidden_act {act!r} is not supported; supported: {', '.join(ACTS)}")
    rope = vc.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise VisionConfigError(f"vision_config rope type {rope.get('rope_type')!r}: the tower runs axial 2D rotary")
    section = tuple(int(s) for s in ((text.get("rope_parameters") or {}).get("mrope_section") or MROPE_SECTION))
    if len(section) != 3:
        raise VisionConfigError(f"mrope_section {list(section)} must give three counts (time, height, width)")

    def ints(key: str, default: int) -> int:
        v = vc.get(key, default)
        if isinstance(v, (list, tuple)):  # a [t, h, w] spelling of a square patch
            v = v[-1]
        if int(v) <= 0:
            raise VisionConfigError(f"vision_config.{key} = {v}: it must be positive")
        return int(v)

    cfg = VisionConfig(
        depth=ints("depth", 27), hidden_size=ints("hidden_size", 1152), intermediate_size=ints("intermediate_size", 4304),
        num_heads=ints("num_heads", 16), in_channels=ints("in_channels", 3), patch_size=ints("patch_size", 16),
        temporal_patch_size=ints("temporal_patch_size", 2), spatial_merge_size=ints("spatial_merge_size", 2),
        out_hidden_size=ints("out_hidden_size", int(text.get("hidden_size", 3584))),
        num_position_embeddings=ints("num_position_embeddings", 2304), hidden_act=act,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        image_token_id=int(raw.get("image_token_id", 248056)),
        vision_start_token_id=int(raw.get("vision_start_token_id", 248053)),
        vision_end_token_id=int(raw.get("vision_end_token_id", 248054)), mrope_section=section)  # type: ignore[arg-type]
    if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
        raise VisionConfigError(f"vision hidden_size {cfg.hidden_size} over {cfg.num_heads} heads must give a head "
                                "size divisible by 4 (its rotary halves cover height and width)")
    side = int(round(cfg.num_position_embeddings ** 0.5))
    if side * side != cfg.num_position_embeddings:
        raise VisionConfigError(f"num_position_embeddings {cfg.num_position_embeddings} is not a square grid")
    return cfg


def image_rules(model_dir: str | Path, cfg: VisionConfig) -> ImageRules:
    """preprocessor_config.json of the model directory (or the defaults above where it is absent)."""
    from engine.core.config import files_dir

    path = files_dir(model_dir) / "preprocessor_config.json"
    raw: dict[str, Any] = {}
    if path.exists():
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise VisionConfigError(f"cannot read {path}: {e}") from None
    size = raw.get("size") or {}
    rules = ImageRules(
        min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or MIN_PIXELS),
        max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or MAX_PIXELS),
        patch_size=int(raw.get("patch_size", cfg.patch_size)),
        temporal_patch_size=int(raw.get("temporal_patch_size", cfg.temporal_patch_size)),
        merge_size=int(raw.get("merge_size", cfg.spatial_merge_size)),
        mean=tuple(float(x) for x in raw.get("image_mean", MEAN_STD)),  # type: ignore[arg-type]
        std=tuple(float(x) for x in raw.get("image_std", MEAN_STD)),  # type: ignore[arg-type]
        rescale=float(raw.get("rescale_factor", 1 / 255)), resample=int(raw.get("resample", 3)))
    if (rules.patch_size, rules.temporal_patch_size, rules.merge_size) != (
            cfg.patch_size, cfg.temporal_patch_size, cfg.spatial_merge_size):
        raise VisionConfigError(f"{path}: patch sizes {rules.patch_size}/{rules.temporal_patch_size}/"
                                f"{rules.merge_size} differ from the tower's vision_config")
    if not 0 < rules.min_pixels <= rules.max_pixels:
        raise VisionConfigError(f"{path}: min pixels {rules.min_pixels} must be positive and at most max pixels "
                                f"{rules.max_pixels}")
    return rules


def load(model_dir: str | Path) -> VisionConfig | None:
    from engine.core.config import files_dir

    path = files_dir(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise VisionConfigError(f"cannot read {path}: {e}") from None
    return from_dict(raw)
