"""A ModelProfile document from a Hugging Face config.json: parameter and KV bytes from the shape.

Counts per layer (H hidden, I intermediate, V vocabulary, q/kv heads of dimension d):

  attention        H x q x d (q) + 2 x H x kv x d (k, v) + q x d x H (o)
  linear attention (gated delta-net, Qwen3-Next shape) H x (2 Kd + 2 Vd) (qkvz) + H x 2 nv (b, a)
                   + (2 Kd + Vd) x conv kernel + Vd x H (out), Kd = key heads x key dim, Vd = value heads x value dim
  dense MLP        3 x H x I (gate, up, down)
  MoE MLP          experts x 3 x H x I_moe + router H x experts (+ 3 x H x I_shared for a shared expert)
  embedding, head  V x H each (one matrix when tie_word_embeddings)

Bytes: the linear layers at the format's bits per weight, the embedding and output head at 16 bits
(checkpoint formats) or every parameter at the file's bits (GGUF, see formats.py). Norms and biases are
ignored (under 0.1 % of the parameters). What the shape cannot say is written down in ``assumptions``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from profiles.document import SCHEMA_VERSIONS
from v100plan.errors import BadInput, DocumentError
from v100plan.planner import config_features, config_fields
from v100plan.planner.formats import KV_DTYPES, WEIGHT_FORMATS, KvDtype, WeightFormat, kv_dtype, weight_format
from v100plan.planner.inputs import linear_state_bytes

DEFAULT_CONFIG_FORMAT = "bf16"
# The checkpoint's own dtype (config.json torch_dtype, `dtype` in transformers 5) names the file's format.
_CONFIG_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_QUANT_METHODS = {"gptq": "int4-gptq", "awq": "int4-awq", "auto-round": "int4-autoround", "intel/auto-round": "int4-autoround"}
# What a checkpoint's config carries at the top level and its multimodal wrapper keeps outside text_config.
_OUTER_KEYS = ("quantization_config", "torch_dtype", "dtype")


def config_format(cfg: dict[str, Any]) -> tuple[str, str]:
    """(weight format, why) a config.json says its files are in: a 4-bit GPTQ/AWQ/AutoRound quantization_config
    (``bits``, AutoAWQ's older ``w_bit``), else the torch_dtype; bf16 when it says neither. A quantization_config
    of another method or width is refused (exit 2) rather than planned as 16-bit."""
    q = cfg.get("quantization_config")
    if isinstance(q, dict):
        method = str(q.get("quant_method") or "").lower()
        bits = q.get("bits", q.get("w_bit"))
        if method in _QUANT_METHODS and bits == 4:
            return _QUANT_METHODS[method], f"quantization_config {method} 4-bit"
        if method in ("fp8", "fbgemm_fp8", "compressed-tensors") and _fp8(q):
            return "fp8", f"quantization_config {method} (8-bit float weights)"
        raise BadInput(f"config.json's quantization_config is {method or 'unnamed'} at {bits} bits, which the planner does "
                       "not read as a weight format", hint="give the weights' format with --weights (`v100plan plan --help` lists them)")
    dt = cfg.get("torch_dtype") or cfg.get("dtype")
    if dt in _CONFIG_DTYPES:
        return _CONFIG_DTYPES[dt], f"torch_dtype {dt}"
    return DEFAULT_CONFIG_FORMAT, "the config names no dtype"
DEFAULT_KV = "fp16"


def _fp8(q: dict[str, Any]) -> bool:
    """An fp8 quantization_config: fp8 by method, or compressed-tensors whose weights are 8-bit floats."""
    if str(q.get("quant_method")).lower() in ("fp8", "fbgemm_fp8"):
        return True
    groups = q.get("config_groups") or {}
    ws = [g.get("weights") or {} for g in groups.values() if isinstance(g, dict)]
    return bool(ws) and all(w.get("num_bits") == 8 and w.get("type") == "float" for w in ws)


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs (Qwen3.5 / 3.6 as downloaded: ``Qwen3_5ForConditionalGeneration``) nest the language model
    under text_config and keep quantization_config and the dtype at the top level; either level is read, the inner
    one first."""
    inner = cfg.get("text_config")
    if isinstance(inner, dict):
        merged = {**inner}
        for key in ("model_type", "_name_or_path") + _OUTER_KEYS:
            if key in cfg and merged.get(key) is None:
                merged[key] = cfg[key]
        return merged
    return cfg


def _need(cfg: dict[str, Any], key: str, source: str) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise DocumentError(source, f"config.json has no positive integer {key!r}", json_path=f"$.{key}",
                            hint="dense Llama/Qwen2/Qwen3/Mistral, Qwen3-MoE, Mixtral and Qwen3-Next shapes are understood")
    return v


def _slug(text: str) -> str:
    s = re.sub(r"[^a-z0-9.-]+", "-", text.lower()).strip("-.")
    return s or "model"


def model_id_for(cfg: dict[str, Any], source: str) -> str:
    """The config's _name_or_path, else the file's name (llama-3.1-8b.config.json), else its directory's."""
    name = cfg.get("_name_or_path")
    if not name:
        stem = Path(source).name.removesuffix(".json").removesuffix(".config")
        name = Path(source).parent.name if stem == "config" else stem
    return _slug(str(name).split("/")[-1])


def shape_counts(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Parameter counts by role, and the attention geometry, from a (text) config."""
    L = _need(cfg, "num_hidden_layers", source)
    H = _need(cfg, "hidden_size", source)
    V = _need(cfg, "vocab_size", source)
    q = _need(cfg, "num_attention_heads", source)
    kv = cfg.get("num_key_value_heads") or q
    d = cfg.get("head_dim") or H // q
    assumptions: list[str] = []
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == L:
        linear = sum(1 for t in types if t == "linear_attention")
        full = sum(1 for t in types if t in ("full_attention", "attention", "sliding_attention"))
        if linear + full != L:
            assumptions.append(f"layer_types has {L - linear - full} layer(s) of unknown kind, counted as full attention")
            full = L - linear
    elif cfg.get("full_attention_interval"):
        full = L // int(cfg["full_attention_interval"])
        linear = L - full
    else:
        full, linear = L, 0
    config_features.refuse_unmodelled(cfg, source)
    latent = config_features.mla(cfg, H, q)
    if latent:
        attn = latent["params_per_layer"]
        kv, d = 1, latent["latent"]          # the absorbed form: one KV head of the latent's width, shared
        assumptions.append(f"MLA: {latent['kv_lora_rank']} + {latent['qk_rope_head_dim']} latent values cached per token "
                           "and layer (K and V from one latent, replicated under tensor parallel)")
    else:
        attn = H * q * d + 2 * H * kv * d + q * d * H
    if cfg.get("attn_output_gate"):
        attn += H * q * d
    lin = 0
    state_bytes = 0.0
    linear_shape: dict[str, int] | None = None
    if linear:
        nk = cfg.get("linear_num_key_heads") or 0
        nv = cfg.get("linear_num_value_heads") or 0
        dk = cfg.get("linear_key_head_dim") or 0
        dv = cfg.get("linear_value_head_dim") or 0
        kern = cfg.get("linear_conv_kernel_dim") or 4
        if not (nk and nv and dk and dv):
            raise DocumentError(source, "linear-attention layers without linear_num_key_heads / linear_num_value_heads / "
                                "linear_key_head_dim / linear_value_head_dim", json_path="$.layer_types")
        Kd, Vd = nk * dk, nv * dv
        lin = H * (2 * Kd + 2 * Vd) + H * 2 * nv + (2 * Kd + Vd) * kern + Vd * H
        linear_shape = {"key_heads": nk, "value_heads": nv, "key_head_dim": dk, "value_head_dim": dv, "conv_kernel": kern,
                        "state_bytes_per_element": 4, "conv_bytes_per_element": 2}
        state_bytes = linear_state_bytes(linear, linear_shape)
        assumptions.append("linear-attention state kept in fp32 (nv x dk x dv x 4 bytes per layer) plus a 16-bit conv window")
    I = cfg.get("intermediate_size") or 0  # noqa: E741
    dense_mlp_layers = L
    experts = active = expert_params = active_expert_params = shared = router = 0
    routed = config_features.moe(cfg, L, H, I)
    if routed:
        experts, active, dense_mlp_layers = routed["experts"], routed["active"], routed["dense_layers"]
        expert_params, active_expert_params = routed["expert_params"], routed["active_expert_params"]
        shared, router = routed["shared"], routed["router"]
        if not active:
            raise DocumentError(source, "MoE config without num_experts_per_tok", json_path="$.num_experts_per_tok")
        if dense_mlp_layers:
            assumptions.append(f"MoE: {routed['moe_layers']} expert layers, the first {dense_mlp_layers} dense"
                               if cfg.get("first_k_dense_replace") is not None else
                               f"MoE: {routed['moe_layers']} expert layers, {dense_mlp_layers} dense (mlp_only_layers)")
    elif not I:
        raise DocumentError(source, "config.json has no intermediate_size", json_path="$.intermediate_size")
    dense_mlp = dense_mlp_layers * 3 * H * I
    tied = bool(cfg.get("tie_word_embeddings", False))
    embed = V * H
    head = 0 if tied else V * H
    native, rope_notes = config_features.rope_context(cfg, source)
    assumptions += rope_notes
    window, window_layers, window_note = config_features.sliding_layers(cfg, full, native)
    if window_note:
        assumptions.append(window_note)
    mtp = int(cfg.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers") or 0)
    if mtp:
        assumptions.append(f"{mtp} MTP draft layer(s) in config.json: sized as one average layer plus the output head; "
                           "their resident weights are not added")
    return {
        "layers": L, "full": full, "linear": linear, "hidden": H, "vocab": V, "q": q, "kv": kv, "head_dim": d,
        "intermediate": I or None, "attn": full * attn, "lin": lin * linear, "dense_mlp": dense_mlp, "shared": shared,
        "router": router, "experts": experts, "active": active, "expert_params": expert_params,
        "active_expert_params": active_expert_params, "embed": embed, "head": head, "tied": tied,
        "state_bytes": state_bytes, "mtp": mtp, "assumptions": assumptions,
        "native_context": native, "kv_latent_dim": latent["latent"] if latent else 0, "linear_shape": linear_shape,
        "window": window, "window_layers": window_layers,
    }


def _gb(params: float, bits: float) -> float:
    return params * bits / 8 / 1e9


def model_doc(cfg_in: dict[str, Any], source: str, fmt_name: str | None = None, kv_name: str | None = None,
              provenance_doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """A model_profile document (kind "model_profile") for the config's shape in weight format ``fmt_name``."""
    cfg = _text_config(cfg_in)
    own, why = config_format(cfg)
    fmt: WeightFormat | None = weight_format(fmt_name or own)
    if fmt is None:
        raise BadInput(f"unknown weight format {fmt_name!r}", hint=f"one of: {', '.join(WEIGHT_FORMATS)}, exl2-BITS (EXL2, 2.0 to 8.0 bits per weight)")
    kvd: KvDtype | None = kv_dtype(kv_name or DEFAULT_KV)
    if kvd is None:
        raise BadInput(f"unknown KV cache dtype {kv_name!r}", hint=f"one of: {', '.join(KV_DTYPES)}")
    c = shape_counts(cfg, source)
    assumptions = list(c["assumptions"])
    outer = {k: v for k, v in cfg_in.items() if k != "text_config"} if cfg is not cfg_in else None
    assumptions += [f"unmodelled: config.json field {f!r} (not in the planner's known fields: "
                    "v100plan/planner/config_fields.py)" for f in config_fields.unknown(cfg, outer)]
    vision_gb, vision = _vision_tower(cfg_in, assumptions)
    if not fmt_name:
        assumptions.append(f"no --weights given: {fmt.name}, as the checkpoint's config says ({why})")
    linear_dense = c["attn"] + c["lin"] + c["dense_mlp"] + c["shared"] + c["router"]
    if fmt.whole_file:
        emb_bits = head_bits = fmt.bits_per_weight
    else:
        emb_bits = head_bits = max(16.0, fmt.bits_per_weight)
        if fmt.head_bits is not None:
            head_bits = fmt.head_bits
            assumptions.append(f"{fmt.name}: linear layers at {fmt.bits_per_weight:g} bits, output head at {head_bits:g}, "
                               "embedding at 16 bits")
        elif fmt.bits_per_weight < 16:
            assumptions.append(f"{fmt.name}: linear layers at {fmt.bits_per_weight:g} bits, embedding and output head kept at 16 bits")
    dense_gb = _gb(linear_dense, fmt.bits_per_weight)
    expert_gb = _gb(c["expert_params"], fmt.bits_per_weight)
    embed_gb = _gb(c["embed"], emb_bits)
    head_gb = _gb(c["head"], head_bits) if c["head"] else 0.0
    total = dense_gb + expert_gb + embed_gb + head_gb + vision_gb
    # Per token the embedding is one row; a tied matrix is read whole as the output head.
    head_read = embed_gb if c["tied"] else head_gb
    decode_read = dense_gb + head_read
    split = dense_gb + expert_gb + head_gb + (embed_gb if c["tied"] else 0.0)
    replicated = (0.0 if c["tied"] else embed_gb) + vision_gb  # the vision tower is whole on every rank
    params_total = linear_dense + c["expert_params"] + c["embed"] + c["head"]
    active_linear = linear_dense + c["active_expert_params"] + c["embed"]  # head (or tied embedding) multiplies every token
    native = c["native_context"]
    if native is None:
        native = 4096
        assumptions.append("config.json has no max_position_embeddings: native context taken as 4,096")
    name = model_id_for(cfg, source)
    src = f"{source} (config.json)"
    if c["experts"]:
        assumptions.append("MoE: uniform routing assumed for the experts a round touches")
    doc: dict[str, Any] = {
        "kind": "model_profile", "schema_version": SCHEMA_VERSIONS["model_profile"],
        "provenance": provenance_doc or {"tool": "v100plan", "tool_version": "0.1.0", "git_revision": None,
                                         "created_utc": "1970-01-01T00:00:00Z", "host": "derived", "inputs": {"config": source}},
        "id": f"{name}-{fmt.name.replace('_', '-')}", "name": f"{name} ({fmt.name}, from config.json)",
        "description": f"Derived from {source}: {c['layers']} layers, hidden {c['hidden']}, {c['q']} q / {c['kv']} KV heads",
        "family": name, "format": fmt.name, "architecture": _arch(c), "parameters_b": round(params_total / 1e9, 3),
        "layers": {"total": c["layers"], "full_attention": c["full"], "linear_attention": c["linear"],
                   "sources": {"total": src, "full_attention": src, "linear_attention": src}},
        "attention": {"q_heads": c["q"], "kv_heads": c["kv"], "head_dim": c["head_dim"],
                      **({"kv_latent_dim": c["kv_latent_dim"]} if c["kv_latent_dim"] else {}),
                      **({"sliding_window": c["window"], "sliding_layers": c["window_layers"]} if c["window"] else {}),
                      "sources": {"q_heads": src, "kv_heads": src, "head_dim": src,
                                  **({"kv_latent_dim": f"{src}: kv_lora_rank + qk_rope_head_dim (MLA)"}
                                     if c["kv_latent_dim"] else {})}},
        "hidden_size": c["hidden"], "intermediate_size": c["intermediate"], "vocab_size": c["vocab"],
        "native_context": native,
        "weights": {"total_gb": round(total, 4), "split_gb": round(split, 4), "replicated_gb": round(replicated, 4),
                    "decode_read_gb": round(decode_read, 4), "head_gb": round(head_read, 4),
                    "sources": {"total_gb": f"shape x bits: {fmt.name} {fmt.bits_per_weight:g} bits ({fmt.source})",
                                "head_gb": "output head, vocab x hidden (the tied embedding when the two are one matrix)",
                                "split_gb": "linear layers, experts and the output head (column/row/vocab parallel)",
                                "replicated_gb": "token embedding (and norms)" + (", and the vision tower" if vision_gb
                                                                                   else "") + ", whole on every rank",
                                "decode_read_gb": "every dense linear layer and the output head; experts added per round"}},
        "kv_cache": {"dtype": kvd.name, "bytes_per_element": round(kvd.bytes_for(c["head_dim"]), 6), "overhead_bytes_per_token": 0,
                     "sources": {"bytes_per_element": kvd.source, "overhead_bytes_per_token": "none modelled: the shape only"}},
        "state_bytes_per_sequence": c["state_bytes"],
        **({"linear_attention": {**c["linear_shape"], "sources": {k: src for k in c["linear_shape"]}}} if c["linear_shape"] else {}),
        "matrix_flops_per_token": 2.0 * active_linear,
        "tp": {"allreduces_per_round": 2 * c["layers"], "allreduce_bytes_per_token": c["hidden"] * 2,
               "sources": {"allreduces_per_round": "2 per layer (attention/linear-attention output and MLP down projection)",
                           "allreduce_bytes_per_token": f"hidden {c['hidden']} x 2 bytes (16-bit activations)"}},
        "draft": None if not c["mtp"] else {
            "kind": "mtp", "max_draft_tokens": 3,
            "read_gb_per_step": round((dense_gb / c["layers"]) + head_read + expert_gb / c["layers"] * (c["active"] / c["experts"] if c["experts"] else 0), 4),
            "sources": {"max_draft_tokens": f"{src}: MTP layer present; 3 drafts as the field report ran",
                        "read_gb_per_step": "one average layer's dense bytes (+ its active experts) + the output head"}},
        "acceptance": None,
        **({"vision": vision} if vision else {}),
        "moe": None if not c["experts"] else {
            "experts": c["experts"], "active_experts": c["active"], "expert_gb": round(expert_gb, 4),
            "sources": {"experts": src, "active_experts": src, "expert_gb": f"routed experts at {fmt.name}"}},
        "assumptions": assumptions,
        "sources": {"parameters_b": f"derived from the shape in {src}", "hidden_size": src, "vocab_size": src,
                    "native_context": (f"{src}: max_position_embeddings and its rope scaling" if c["native_context"]
                                       else "assumed"),
                    "state_bytes_per_sequence": "linear-attention state from the shape" if c["linear"] else "no recurrent state",
                    "matrix_flops_per_token": "2 x (active linear parameters + output head)",
                    **({"intermediate_size": src} if c["intermediate"] else {})},
        "unavailable": {**({"intermediate_size": "MoE: see moe"} if not c["intermediate"] else {}),
                        "acceptance": "not known for a model read from config.json: give --acceptance",
                        **({"draft": "no MTP layer in config.json"} if not c["mtp"] else {})},
    }
    return doc


VISION_BITS = 16  # the tower stays 16-bit in 4-bit checkpoints too (the bundled engine loads it in the model's dtype)


IMAGE_SIDE = 1024  # the image an image's prefill is priced for: 1024 x 1024 pixels (docs/vision.md measured one)


def _vision_tower(cfg_in: dict[str, Any], assumptions: list[str]) -> tuple[float, dict[str, Any] | None]:
    """A multimodal config's vision tower (engine.vision.config: the bundled engine's own counts): its GB at 16
    bits, replicated on every rank, and the model profile's ``vision`` block (its matrix FLOPs and image tokens for
    one 1024 x 1024 image, which the plan prices as prefill); (0, None) for a text-only config."""
    if not isinstance(cfg_in.get("vision_config"), dict):
        return 0.0, None
    from engine.vision import config as vision_config  # stdlib-only

    try:
        tower = vision_config.from_dict(cfg_in)
    except (vision_config.VisionConfigError, TypeError, ValueError) as e:
        assumptions.append(f"vision_config: a tower the planner cannot size ({e}); its memory is not counted")
        return 0.0, None
    if tower is None:
        return 0.0, None
    gb = _gb(tower.param_count(), VISION_BITS)
    # 1024 is a multiple of patch x merge for the family (16 x 2): the processor keeps the size, no resize
    side = IMAGE_SIDE // (tower.patch_size * tower.spatial_merge_size) * tower.spatial_merge_size
    patches = side * side
    assumptions.append(f"vision tower: {tower.param_count() / 1e9:.3f} B parameters, {gb:.3f} GB at 16 bits, whole on "
                       "every rank (counted in memory, not read per decoded token); an image's prefill is priced for "
                       f"a {IMAGE_SIDE} x {IMAGE_SIDE} image; `serve --no-vision` frees the tower")
    src = "engine/vision/config.py (the bundled engine's tower)"
    return gb, {"params_b": round(tower.param_count() / 1e9, 4), "gb": round(gb, 4),
                "image_pixels": IMAGE_SIDE * IMAGE_SIDE, "patches": patches,
                "image_tokens": patches // tower.merge_unit, "tower_flops": float(tower.flops(patches)),
                "sources": {"params_b": src, "gb": f"{src}, at {VISION_BITS} bits",
                            "patches": f"{IMAGE_SIDE} x {IMAGE_SIDE} pixels in {tower.patch_size}-pixel patches",
                            "image_tokens": f"patches / {tower.merge_unit} (the merger's {tower.spatial_merge_size} x "
                                            f"{tower.spatial_merge_size})",
                            "tower_flops": f"{src}: VisionConfig.flops (linear layers and attention over the patches)"}}


def _arch(c: dict[str, Any]) -> str:
    parts = ["hybrid: full attention + linear attention" if c["linear"] else "dense transformer (GQA)"
             if c["kv"] < c["q"] else "dense transformer"]
    if c["experts"]:
        parts.append(f"MoE {c['active']} of {c['experts']} experts")
    return ", ".join(parts)


def reformat_doc(doc: dict[str, Any], fmt_name: str, siblings: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """A catalogue model in another weight format: the family's own profile when one exists, else the
    profile scaled by bits (new bits / the profile's bits per parameter), said in the returned notes."""
    fmt = weight_format(fmt_name)
    if fmt is None:
        raise BadInput(f"unknown weight format {fmt_name!r}", hint=f"one of: {', '.join(WEIGHT_FORMATS)}, exl2-BITS (EXL2, 2.0 to 8.0 bits per weight)")
    if doc.get("format") == fmt.name:
        return doc, []
    for s in siblings:
        if s.get("family") == doc.get("family") and s.get("format") == fmt.name:
            return s, [f"--weights {fmt.name}: the catalogue's own {s['id']} profile"]
    w = doc["weights"]
    old_bits = w["total_gb"] * 8e9 / (doc["parameters_b"] * 1e9)
    ratio = fmt.bits_per_weight / old_bits
    new = json.loads(json.dumps(doc))
    for k in ("total_gb", "split_gb", "replicated_gb", "decode_read_gb"):
        new["weights"][k] = round(w[k] * ratio, 4)
    if new.get("moe"):
        new["moe"]["expert_gb"] = round(new["moe"]["expert_gb"] * ratio, 4)
    new["id"], new["format"] = f"{doc['family']}-{fmt.name.replace('_', '-')}", fmt.name
    new["name"] = f"{doc['name']} re-expressed as {fmt.name}"
    note = (f"--weights {fmt.name}: {doc['id']} has no per-tensor shape; its bytes scaled by {fmt.bits_per_weight:g} / "
            f"{old_bits:.2f} bits per parameter ({fmt.source})")
    new.setdefault("assumptions", []).append(note)
    return new, [note]


def with_kv_dtype(doc: dict[str, Any], kv_name: str) -> dict[str, Any]:
    """The same model with another KV-cache element type (the named overhead per token is kept)."""
    kvd = kv_dtype(kv_name)
    if kvd is None:
        raise BadInput(f"unknown KV cache dtype {kv_name!r}", hint=f"one of: {', '.join(KV_DTYPES)}")
    new = json.loads(json.dumps(doc))
    new["kv_cache"]["dtype"] = kvd.name
    new["kv_cache"]["bytes_per_element"] = round(kvd.bytes_for(int(doc["attention"]["head_dim"])), 6)
    new["kv_cache"].setdefault("sources", {})["bytes_per_element"] = f"--kv-cache-dtype {kvd.name}: {kvd.source}"
    return new
