"""What a config.json declares beyond a dense GQA shape: read where the planner models it, refused where not.

Read (each one a formula the planner uses):

  rope_scaling / rope_parameters   default, linear, llama3, mrope: the context is max_position_embeddings;
                                   yarn, dynamic, longrope: up to factor x original_max_position_embeddings
                                   (the larger of that and max_position_embeddings)
  MLA (kv_lora_rank)               per layer q: H x q_lora + q_lora x heads x (nope + rope) (or H x heads x (nope + rope)),
                                   kv: H x (kv_lora + rope) + kv_lora x heads x (nope + v), o: heads x v x H;
                                   cached per token and layer: the latent kv_lora + rope values, K and V from the
                                   same latent (the absorbed form is one shared KV head: replicated under tensor
                                   parallel, as vLLM and SGLang keep it)
  routed + shared experts          n_routed_experts / num_experts, n_shared_experts x moe_intermediate_size, the
                                   first first_k_dense_replace layers dense (intermediate_size)

  sliding_window                   K/V of a window layer capped at the window (sliding_layers below)

Refused (a plan would be silently wrong): chunked attention, MoE on every k-th layer only,
unknown rope types, DeepSeek's sparse-attention indexer, cross-attention layers. Each refusal names its field.
"""

from __future__ import annotations

from typing import Any

from v100plan.errors import DocumentError
from v100plan.planner import config_fields

# Rope types whose context is max_position_embeddings itself, and those that extend an original length.
_ROPE_AS_IS = ("default", "linear", "llama3", "mrope")
_ROPE_EXTENDS = ("yarn", "dynamic", "longrope")
_HINT = "the planner models dense and MoE GQA/MLA shapes with full attention (and Qwen3-Next linear attention)"


def _refuse(source: str, field: str, what: str) -> DocumentError:
    return DocumentError(source, f"config.json declares {field}: {what}; the planner does not model it and will "
                         "not plan it as something else", json_path=f"$.{field}", hint=_HINT)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def refuse_unmodelled(cfg: dict[str, Any], source: str) -> None:
    """Raise DocumentError (exit 2) naming the first field the config declares that the planner does not model
    (config_fields.REFUSED and the structures below)."""
    for field in sorted(cfg):
        if (what := config_fields.refused(field)) and cfg[field] not in (None, 0, False, [], {}):
            raise _refuse(source, field, what)
    types = cfg.get("layer_types")
    if isinstance(types, list):
        odd = sorted({t for t in types if t in ("chunked_attention",)})
        if odd:
            raise _refuse(source, "layer_types", f"{', '.join(odd)} layers (K/V capped per chunk)")
    for field, what in (("attention_chunk_size", "chunked attention"),
                        ("index_topk", "a sparse-attention indexer (top-k K/V positions per token)"),
                        ("cross_attention_layers", "cross-attention layers")):
        if cfg.get(field):
            raise _refuse(source, field, what)
    for field in ("moe_layer_freq", "decoder_sparse_step", "interleave_moe_layer_step"):
        v = cfg.get(field)
        if v is not None and v != 1 and _experts(cfg):
            raise _refuse(source, field, f"experts on every {v}-th layer only")
    if cfg.get("n_routed_experts") and cfg.get("num_experts_per_tok") is None:
        raise _refuse(source, "n_routed_experts", "routed experts without num_experts_per_tok")


def _rope(cfg: dict[str, Any]) -> dict[str, Any] | None:
    rs = cfg.get("rope_scaling")
    if not isinstance(rs, dict):
        rs = cfg.get("rope_parameters")
    return rs if isinstance(rs, dict) else None


def rope_context(cfg: dict[str, Any], source: str) -> tuple[int | None, list[str]]:
    """(native context, assumptions) from max_position_embeddings and the rope scaling (module docstring)."""
    mpe = _int(cfg.get("max_position_embeddings"))
    rs = _rope(cfg)
    if rs is None:
        return mpe, []
    kind = str(rs.get("rope_type") or rs.get("type") or "default")
    key = "rope_scaling" if isinstance(cfg.get("rope_scaling"), dict) else "rope_parameters"
    if kind in _ROPE_AS_IS:
        return mpe, []
    if kind not in _ROPE_EXTENDS:
        raise DocumentError(source, f"config.json declares {key}.rope_type {kind!r}, which the planner does not know: "
                            "its context cannot be read", json_path=f"$.{key}.rope_type",
                            hint=f"known: {', '.join(_ROPE_AS_IS + _ROPE_EXTENDS)}")
    orig = _int(rs.get("original_max_position_embeddings")) or _int(cfg.get("original_max_position_embeddings")) or mpe
    factor = rs.get("factor")
    if not isinstance(factor, (int, float)) and orig and mpe:
        factor = mpe / orig                     # longrope (Phi-3) names no factor: the ratio of the two lengths
    if not isinstance(factor, (int, float)) or not orig or factor <= 0:
        raise DocumentError(source, f"config.json declares {key}.rope_type {kind!r} without a factor and an original "
                            "length", json_path=f"$.{key}.factor", hint="give factor and original_max_position_embeddings")
    ctx = max(mpe or 0, int(round(factor * orig)))
    return ctx, [f"{key} {kind}: context up to factor {factor:g} x original {orig:,} = {ctx:,} tokens"]


def _experts(cfg: dict[str, Any]) -> int:
    return int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def mla(cfg: dict[str, Any], H: int, q: int) -> dict[str, int] | None:
    """MLA's parameters per layer and its cached latent width (module docstring); None for other attention."""
    kv_lora = _int(cfg.get("kv_lora_rank"))
    if not kv_lora:
        return None
    q_lora = _int(cfg.get("q_lora_rank")) or 0
    rope = _int(cfg.get("qk_rope_head_dim")) or 0
    nope = _int(cfg.get("qk_nope_head_dim")) or 0
    vd = _int(cfg.get("v_head_dim")) or nope
    qk = nope + rope
    q_params = H * q_lora + q_lora * q * qk if q_lora else H * q * qk
    params = q_params + H * (kv_lora + rope) + kv_lora * q * (nope + vd) + q * vd * H
    return {"params_per_layer": params, "latent": kv_lora + rope, "kv_lora_rank": kv_lora, "qk_rope_head_dim": rope}


def moe(cfg: dict[str, Any], L: int, H: int, I: int) -> dict[str, Any] | None:  # noqa: E741
    """Routed and shared experts: which layers carry them and their parameter counts; None for a dense model."""
    experts = _experts(cfg)
    if not experts:
        return None
    active = int(cfg.get("num_experts_per_tok") or 0)
    im = int(cfg.get("moe_intermediate_size") or I)
    if cfg.get("first_k_dense_replace") is not None:
        dense_layers = int(cfg["first_k_dense_replace"])
    else:
        dense_layers = len(cfg.get("mlp_only_layers") or [])
    moe_layers = L - dense_layers
    qwen_si = int(cfg.get("shared_expert_intermediate_size") or 0)      # Qwen-MoE: one gated shared expert
    si = qwen_si or int(cfg.get("n_shared_experts") or 0) * im          # DeepSeek: n shared experts, ungated
    return {"experts": experts, "active": active, "dense_layers": dense_layers, "moe_layers": moe_layers,
            "expert_params": moe_layers * experts * 3 * H * im, "active_expert_params": moe_layers * active * 3 * H * im,
            "router": moe_layers * H * experts, "shared": moe_layers * (3 * H * si + (H if qwen_si else 0))}


def sliding_layers(cfg: dict[str, Any], attention_layers: int, context: int | None) -> tuple[int, int, str | None]:
    """(window tokens, how many attention layers slide, why) from the config; (0, 0, None) without a window that
    is shorter than the context. Which layers slide: layer_types' sliding_attention entries; else every
    sliding_window_pattern-th layer is global (Gemma 2/3); else Qwen2's layers from max_window_layers on; else
    every layer (Mistral 7B v0.1)."""
    window = _int(cfg.get("sliding_window"))
    types = cfg.get("layer_types")
    named = isinstance(types, list) and "sliding_attention" in types       # layer_types wins over use_sliding_window
    if not window or (cfg.get("use_sliding_window") is False and not named) or window >= (context or 0):
        return 0, 0, None
    pattern = _int(cfg.get("sliding_window_pattern")) or _int(cfg.get("_sliding_window_pattern"))
    if isinstance(types, list) and "sliding_attention" in types:
        n, why = sum(1 for t in types if t == "sliding_attention"), "layer_types"
    elif isinstance(types, list) and types:
        return 0, 0, None                                   # layer_types names no sliding layer: the window is unused
    elif pattern:
        n, why = attention_layers - attention_layers // pattern, f"sliding_window_pattern {pattern}: every {pattern}-th layer global"
    elif _int(cfg.get("max_window_layers")) is not None and cfg.get("use_sliding_window"):
        n, why = max(0, attention_layers - int(cfg["max_window_layers"])), "layers from max_window_layers on"
    else:
        n, why = attention_layers, "every layer (no layer_types or pattern)"
    return window, min(n, attention_layers), f"sliding window {window:,} tokens on {n} of {attention_layers} attention layers ({why}): their K/V is capped at the window"
