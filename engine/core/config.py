"""Model shape as plain data, read from a Hugging Face config.json: Llama / Qwen2 / Qwen3 dense decoders, and
the hybrid class of Qwen3.5 (Gated DeltaNet linear-attention layers between gated full-attention layers;
``qwen3_5_text``, and the multimodal ``qwen3_5`` wrapper whose text config sits under ``text_config``) and of
Qwen3-Next (``qwen3_next``: the same layers with a sparse mixture-of-experts MLP, engine.core.moe)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

DENSE_TYPES = ("llama", "qwen2", "qwen3")
HYBRID_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_next")
SUPPORTED_TYPES = DENSE_TYPES + HYBRID_TYPES
LAYER_KINDS = ("full_attention", "linear_attention")
MLP_KINDS = ("dense", "moe")  # a SwiGLU MLP, or Qwen3-Next's routed experts plus a gated shared expert
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    # The hybrid class (Qwen3.5). Dense models: every layer "full_attention", no gate, the Llama norm, full RoPE.
    layer_types: tuple[str, ...] = ()
    attn_output_gate: bool = False  # q_proj gives [query | gate] per head; attention output * sigmoid(gate)
    zero_centred_norm: bool = False  # RMSNorm weight applied as (1 + w), product in float32 (Qwen3.5)
    rotary_dim: int = 0  # RoPE on the first rotary_dim of each head (partial_rotary_factor); 0 = head_dim
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    weight_prefix: str = "model."  # where the decoder's tensors sit ("model.language_model." in the wrapper)
    quantization: Any = None  # engine.core.quant.QuantConfig of a GPTQ / AWQ checkpoint, None when dense
    mtp_layers: int = 0  # MTP draft layers the checkpoint carries (``mtp.*``; mtp_num_hidden_layers, Qwen3.5)
    # Qwen3-Next's sparse MLP (engine.core.moe): per layer "dense" or "moe"; () = every layer dense
    mlp_types: tuple[str, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each routed expert's width
    shared_expert_intermediate_size: int = 0  # the shared expert's width (scaled by sigmoid(shared_expert_gate))
    norm_topk_prob: bool = True  # the k chosen experts' probabilities renormalised to sum to 1

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if not self.mlp_types:
            object.__setattr__(self, "mlp_types", ("dense",) * self.num_layers)

    @property
    def moe(self) -> bool:
        return "moe" in self.mlp_types

    @property
    def hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the linear-attention layers' causal conv: [q | k | v] of in_proj_qkv."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def n_full(self) -> int:
        return self.layer_types.count("full_attention")

    @property
    def n_linear(self) -> int:
        return self.layer_types.count("linear_attention")

    def linear_state_bytes(self, conv_dtype_bytes: int) -> int:
        """Per sequence: every linear-attention layer's float32 recurrent state [value heads, key dim, value
        dim] and its conv state (the last kernel - 1 inputs of every conv channel, in the model's dtype)."""
        rec = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        conv = self.conv_dim * (self.linear_conv_kernel_dim - 1) * conv_dtype_bytes
        return self.n_linear * (rec + conv)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def param_count(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q_rows = self.q_size * (2 if self.attn_output_gate else 1)
        full = d * (q_rows + 2 * self.kv_size) + self.q_size * d + (2 * self.head_dim if self.qk_norm else 0)
        nv = self.linear_num_value_heads
        linear = (d * (self.conv_dim + self.linear_value_dim + 2 * nv) + self.conv_dim * self.linear_conv_kernel_dim
                  + 2 * nv + self.linear_value_head_dim + self.linear_value_dim * d)
        n_moe = self.mlp_types.count("moe")
        moe = d * (self.num_experts * (3 * self.moe_intermediate_size + 1) + 3 * self.shared_expert_intermediate_size
                   + 1)  # routed experts and their router, the shared expert and its gate
        mlps = (self.num_layers - n_moe) * 3 * d * f + n_moe * moe
        head = 0 if self.tie_word_embeddings else v * d
        return (mlps + self.num_layers * 2 * d + self.n_full * full + self.n_linear * linear + v * d + head + d)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K/V bytes per position: full-attention layers only (linear attention keeps a fixed-size state)."""
        return self.n_full * 2 * self.kv_size * dtype_bytes


def from_dict(raw: dict[str, Any]) -> ModelConfig:
    mt = raw.get("model_type")
    if mt not in SUPPORTED_TYPES:
        raise ConfigError(f"model_type {mt!r} is not supported; this engine runs {', '.join(SUPPORTED_TYPES)}")
    quantization = _quantization(raw)
    if mt == "qwen3_next" and quantization is not None:
        raise ConfigError("quantization_config: a qwen3_next model runs dense only (packed experts are not run)")
    if mt in HYBRID_TYPES:
        return dataclasses.replace(_hybrid(raw), quantization=quantization)
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
        if rt == "yarn" and scaling.get("factor") is None:
            raise ConfigError("rope_scaling yarn needs its factor (e.g. 4.0 for 32K -> 128K)")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    attention_bias = bool(raw.get("attention_bias", False)) or mt == "qwen2"
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


def _quantization(raw: dict[str, Any]):
    """config.json's quantization_config (top level, or the multimodal wrapper's text_config) parsed, or None."""
    from engine.core import quant_config

    q = raw.get("quantization_config")
    if q is None and isinstance(raw.get("text_config"), dict):
        q = raw["text_config"].get("quantization_config")
    try:
        return quant_config.parse(q)
    except quant_config.QuantError as e:
        raise ConfigError(str(e)) from None


def _need(raw: dict[str, Any], key: str, mt: str) -> Any:
    if raw.get(key) is None:
        raise ConfigError(f"config.json of a {mt} model lacks {key!r}")
    return raw[key]


def _hybrid(raw: dict[str, Any]) -> ModelConfig:
    """Qwen3.5's text decoder: linear_attention (Gated DeltaNet) and full_attention layers per ``layer_types``
    (or every ``full_attention_interval``-th layer full, as transformers builds it), gated attention with q/k
    norms and partial RoPE, zero-centred RMSNorms, SwiGLU MLPs. The multimodal wrapper's text config is read
    from ``text_config`` and its weights from ``model.language_model.``; vision is not served."""
    mt = raw["model_type"]
    prefix = "model."
    top = raw
    if mt == "qwen3_5":
        if not isinstance(raw.get("text_config"), dict):
            raise ConfigError("config.json of a qwen3_5 model lacks its text_config")
        raw = dict(raw["text_config"])
        raw.setdefault("tie_word_embeddings", top.get("tie_word_embeddings", False))
        prefix = "model.language_model."
    n_layers = int(_need(raw, "num_hidden_layers", mt))
    types = raw.get("layer_types")
    if types is None:
        every = int(raw.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
    types = tuple(types)
    if len(types) != n_layers:
        raise ConfigError(f"layer_types lists {len(types)} layers, num_hidden_layers is {n_layers}")
    bad = sorted(set(types) - set(LAYER_KINDS))
    if bad:
        raise ConfigError(f"layer_types holds {bad[0]!r}; this engine runs {', '.join(LAYER_KINDS)}")
    params = raw.get("rope_parameters") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ConfigError(f"rope type {rope_type!r} is not supported for {mt}; supported: default")
    heads = int(_need(raw, "num_attention_heads", mt))
    hidden = int(_need(raw, "hidden_size", mt))
    head_dim = int(raw.get("head_dim") or hidden // heads)
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
    rotary = int(head_dim * factor)
    if rotary <= 0 or rotary % 2 or rotary > head_dim:
        raise ConfigError(f"partial_rotary_factor {factor} gives a rotary dimension of {rotary} of head_dim "
                          f"{head_dim}: it must be even and within the head")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {raw.get('hidden_act')!r} is not supported for {mt}; supported: silu")
    eos = raw.get("eos_token_id", top.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    lin = {k: int(_need(raw, k, mt)) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                               "linear_key_head_dim", "linear_value_head_dim",
                                               "linear_conv_kernel_dim")}
    if lin["linear_num_value_heads"] % lin["linear_num_key_heads"]:
        raise ConfigError(f"linear_num_value_heads = {lin['linear_num_value_heads']} is not a multiple of "
                          f"linear_num_key_heads = {lin['linear_num_key_heads']}")
    moe = _moe(raw, n_layers) if mt == "qwen3_next" else {}
    return ModelConfig(
        model_type=mt, vocab_size=int(_need(raw, "vocab_size", mt)), hidden_size=hidden,
        intermediate_size=int(_need(raw, "intermediate_size", mt)), num_layers=n_layers, num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads), head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(theta), rope_scaling=None,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)), o_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=False, qk_norm=True, max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        bos_token_id=raw.get("bos_token_id", top.get("bos_token_id")), eos_token_ids=eos_ids,
        layer_types=types, attn_output_gate=True, zero_centred_norm=True, rotary_dim=rotary,
        weight_prefix=prefix, mtp_layers=0 if moe else int(raw.get("mtp_num_hidden_layers") or 0), **lin, **moe)


def _moe(raw: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """Qwen3-Next's MLP table as transformers builds it: layer i is sparse when num_experts > 0, i is not in
    mlp_only_layers and (i + 1) % decoder_sparse_step == 0; else a dense MLP of intermediate_size. Its MTP
    draft layer (``mtp.*``) is not run (its tensors are ignored)."""
    mt = raw["model_type"]
    experts = int(raw.get("num_experts", 0) or 0)
    step = int(raw.get("decoder_sparse_step", 1) or 0)
    if step < 1:
        raise ConfigError(f"decoder_sparse_step = {step}: it must be at least 1")
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(not isinstance(i, int) or not 0 <= i < n_layers for i in only):
        raise ConfigError(f"mlp_only_layers {only!r} must list layer indices below num_hidden_layers = {n_layers}")
    types = tuple("moe" if experts > 0 and i not in only and (i + 1) % step == 0 else "dense"
                  for i in range(n_layers))
    out = dict(mlp_types=types, num_experts=experts, norm_topk_prob=bool(raw.get("norm_topk_prob", True)))
    if "moe" not in types:
        return out
    k = int(_need(raw, "num_experts_per_tok", mt))
    if not 1 <= k <= experts:
        raise ConfigError(f"num_experts_per_tok = {k} must be between 1 and num_experts = {experts}")
    sizes = {f: int(_need(raw, f, mt)) for f in ("moe_intermediate_size", "shared_expert_intermediate_size")}
    for f, n in sizes.items():
        if n <= 0:
            raise ConfigError(f"{f} = {n}: this engine runs MoE layers with a routed and a shared expert of width > 0")
    return dict(out, num_experts_per_tok=k, **sizes)


def files_dir(model_dir: str | Path) -> Path:
    """Where config.json and the tokenizer files live: the directory itself, or rank0/ of a
    ``python -m engine shard`` output (every rank directory holds the same copies)."""
    d = Path(model_dir)
    return d / "rank0" if (d / "shard.json").exists() and not (d / "config.json").exists() else d


def load(model_dir: str | Path) -> ModelConfig:
    path = files_dir(model_dir) / "config.json"
    if not path.exists():
        raise ConfigError(f"{path} not found: a model directory holds config.json and *.safetensors")
    return load_file(path)


def load_file(path: str | Path) -> ModelConfig:
    """A config.json file itself (e.g. engine/data/*.config.json, the shapes the benches build)."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    return from_dict(raw)
