"""Model shape as plain data, read from a Hugging Face config.json (Llama / Qwen2 / Qwen3 dense)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A config.json the engine cannot run, with the reason."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # may differ from hidden_size // num_heads (Qwen3 declares it)
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2 always, Llama when the config says so)
    o_bias: bool  # Llama's and Qwen3's attention_bias cover o_proj too; Qwen2 has none there
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    quantization: Any = None  # engine.core.quant.QuantConfig of a GPTQ / AWQ checkpoint, None when dense

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def param_count(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else v * d
        return self.num_layers * per_layer + v * d + head + d

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.num_layers * 2 * self.kv_size * dtype_bytes


def from_dict(raw: dict[str, Any]) -> ModelConfig:
    mt = raw.get("model_type")
    if mt not in SUPPORTED_TYPES:
        raise ConfigError(f"model_type {mt!r} is not supported; this engine runs {', '.join(SUPPORTED_TYPES)}")
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    # transformers >= 5 writes "rope_parameters" (theta and scaling together); older files use
    # top-level rope_theta plus rope_scaling.
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = None if params.get("rope_type", "default") == "default" else params
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling")
    if scaling is not None:
        rt = scaling.get("rope_type", scaling.get("type", "default"))
        if rt not in ROPE_TYPES:
            raise ConfigError(f"rope_scaling type {rt!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    attention_bias = bool(raw.get("attention_bias", False)) or mt == "qwen2"
    from engine.core import quant_config as quant

    try:
        quantization = quant.parse(raw.get("quantization_config"))
    except quant.QuantError as e:
        raise ConfigError(str(e)) from None
    return ModelConfig(
        model_type=mt,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        o_bias=bool(raw.get("attention_bias", False)) and mt != "qwen2",
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=mt == "qwen3",
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        quantization=quantization,
    )


def files_dir(model_dir: str | Path) -> Path:
    """Where config.json and the tokenizer files live: the directory itself, or rank0/ of a
    ``python -m engine shard`` output (every rank directory holds the same copies)."""
    d = Path(model_dir)
    return d / "rank0" if (d / "shard.json").exists() and not (d / "config.json").exists() else d


def load(model_dir: str | Path) -> ModelConfig:
    path = files_dir(model_dir) / "config.json"
    if not path.exists():
        raise ConfigError(f"{path} not found: a model directory holds config.json and *.safetensors")
    return from_dict(json.loads(path.read_text()))
