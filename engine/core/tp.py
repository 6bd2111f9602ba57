"""How each Hugging Face tensor is split under tensor parallelism: one table, one slicing function.

  colwise     split rows (dim 0): q/k/v, gate/up and their biases: each rank gets whole heads / columns
  rowwise     split columns (dim 1): o_proj, down_proj: each rank's partial output is summed by an allreduce
  vocab       split rows (dim 0) of the output head: logits are gathered back in rank order
  replicated  every rank holds all of it: embeddings, norms, q/k norms, o/down biases (added once, by rank 0)
  colwise_qkv a linear-attention layer's in_proj_qkv and conv1d: rows [q | k | v], each part split by heads
              (rank r gets [q_r | k_r | v_r], so its conv channels follow its heads); a packed in_proj_qkv the
              same along its output dimension (dim 1), in whole packed words

Names are canonical: a multimodal wrapper's ``model.language_model.`` reads as ``model.`` (``canonical``);
its vision tower is not part of the decoder (``IGNORED``); the MTP draft layer (``mtp.*``) splits as the decoder.
"""

from __future__ import annotations

import re

from engine.core.config import ModelConfig

# GPTQ / AWQ tensors of a linear layer (engine.core.quant), besides or instead of its dense weight
_PACKED = "qweight|qzeros|scales|g_idx"
# A decoder layer's tensors, or the MTP draft layer's (which split as the decoder's)
_LAYER = r"^(?:model|mtp)\.layers\.\d+\."


def _rule(pattern: str, kind: str) -> tuple[re.Pattern[str], str]:
    return re.compile(pattern), kind


def _layer(rest: str, kind: str) -> tuple[re.Pattern[str], str]:
    """A rule for the tensor ``rest`` names within a layer."""
    return _rule(_LAYER + rest + "$", kind)


RULES: list[tuple[re.Pattern[str], str]] = [
    _rule(r"^model\.embed_tokens\.weight$", "replicated"),
    _rule(r"^model\.norm\.weight$", "replicated"),
    _rule(r"^lm_head\.weight$", "vocab"),
    _layer(r"(input_layernorm|post_attention_layernorm)\.weight", "replicated"),
    _layer(rf"self_attn\.(q|k|v)_proj\.(weight|bias|{_PACKED})", "colwise"),
    _layer(rf"self_attn\.o_proj\.(weight|{_PACKED})", "rowwise"),
    _layer(r"self_attn\.o_proj\.bias", "replicated"),
    _layer(r"self_attn\.(q_norm|k_norm)\.weight", "replicated"),
    _layer(rf"mlp\.(gate|up)_proj\.(weight|bias|{_PACKED})", "colwise"),
    _layer(rf"mlp\.down_proj\.(weight|{_PACKED})", "rowwise"),
    _layer(r"mlp\.down_proj\.bias", "replicated"),
    # Gated DeltaNet (linear attention) layers
    _layer(rf"linear_attn\.in_proj_qkv\.(weight|{_PACKED})", "colwise_qkv"),
    _layer(r"linear_attn\.conv1d\.weight", "colwise_qkv"),
    _layer(rf"linear_attn\.in_proj_(z|b|a)\.(weight|{_PACKED})", "colwise"),
    _layer(r"linear_attn\.(A_log|dt_bias)", "colwise"),
    _layer(rf"linear_attn\.out_proj\.(weight|{_PACKED})", "rowwise"),
    _layer(r"linear_attn\.norm\.weight", "replicated"),
    # Qwen3-Next: in_proj_qkvz / in_proj_ba are grouped per key head ([q k v z] and [b a] of its value heads), so
    # whole row blocks are whole key heads with their value heads (converted to the engine's layout at load:
    # engine.core.qwen3_next); the MoE MLP: every expert split as a dense MLP, router and shared gate replicated
    _layer(r"linear_attn\.in_proj_(qkvz|ba)\.weight", "colwise"),
    _layer(r"mlp\.(experts\.\d+|shared_expert)\.(gate|up)_proj\.weight", "colwise"),
    _layer(r"mlp\.(experts\.\d+|shared_expert)\.down_proj\.weight", "rowwise"),
    _layer(r"mlp\.(gate|shared_expert_gate)\.weight", "replicated"),
    # the MTP draft layer (Qwen3.5): its fc [D, 2D] over [embedding | hidden] is replicated (every rank computes
    # the whole input of its attention layer); its layers split as the decoder's above
    _rule(r"^mtp\.(fc|norm|pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight$", "replicated"),
]

# GPTQ / AWQ tensors (engine.core.quant): stored [inputs, outputs], so their split dims are the dense ones' swapped
PACKED = re.compile(rf"\.({_PACKED})$")

# Tensors some checkpoints carry that the decoder recomputes itself or does not run: RoPE tables, the
# multimodal wrapper's vision tower.
IGNORED = re.compile(r"(rotary_emb\.inv_freq$)|(^model\.visual\.)|(^visual\.)")


def canonical(name: str, cfg: ModelConfig) -> str:
    """The decoder's name for a checkpoint tensor: the wrapper's prefix (cfg.weight_prefix) read as ``model.``."""
    if cfg.weight_prefix != "model." and name.startswith(cfg.weight_prefix):
        return "model." + name[len(cfg.weight_prefix):]
    return name


class ShardError(ValueError):
    """A model that cannot be split this way, with the reason."""


def kind_of(name: str) -> str:
    for pattern, kind in RULES:
        if pattern.match(name):
            return kind
    raise ShardError(f"tensor {name!r} is not part of a Llama/Qwen2/Qwen3 dense or Qwen3.5 / Qwen3-Next hybrid decoder; "
                     f"refusing to guess how to split it")


def check_divisible(cfg: ModelConfig, world: int) -> None:
    """Refuse shapes that do not divide by ``world``, naming each one."""
    problems = []
    sizes = [("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
             ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)]
    if cfg.hybrid:
        sizes += [("linear_num_key_heads", cfg.linear_num_key_heads),
                  ("linear_num_value_heads", cfg.linear_num_value_heads)]
    if cfg.moe:
        sizes += [("moe_intermediate_size", cfg.moe_intermediate_size),
                  ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)]
    for label, n in sizes:
        if n % world:
            problems.append(f"{label} = {n} is not divisible by {world}")
    if problems:
        raise ShardError("cannot split this model over " + f"{world} ranks: " + "; ".join(problems))


def rank_range(length: int, rank: int, world: int) -> tuple[int, int]:
    part = length // world
    return rank * part, (rank + 1) * part


def qkv_segments(cfg: ModelConfig) -> list[int]:
    """Rows of a linear-attention layer's in_proj_qkv / conv channels: [q, k, v]."""
    return [cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim]


def take(source, kind: str, rank: int, world: int, cfg: ModelConfig | None = None, name: str | None = None):
    """This rank's part of ``source`` (a tensor or a safetensors slice, read lazily). ``name``: the tensor's
    name, which says whether it is packed (GPTQ / AWQ: split along split_dim's dimension, in whole words and
    groups)."""
    if kind == "replicated" or world == 1:
        return source[:]
    shape = source.get_shape() if hasattr(source, "get_shape") else list(source.shape)
    if name is not None and PACKED.search(name) and kind in ("colwise", "rowwise"):
        dim = split_dim(kind, name)
        if dim is None:
            return source[:]
        if shape[dim] % world:
            what = "groups" if dim == 0 and not name.endswith("g_idx") else "values or packed words"
            raise ShardError(f"{name}: its {shape[dim]} {what} along dim {dim} do not split into {world} equal "
                             f"parts: a split would cut a packed word or a quantisation group")
        a, b = rank_range(shape[dim], rank, world)
        return source[a:b] if dim == 0 else source[:, a:b]
    if kind == "colwise_qkv":
        import torch

        if cfg is None:
            raise ShardError("a colwise_qkv split needs the model's config")
        if name is not None and PACKED.search(name):
            return _take_packed_qkv(source, shape, rank, world, cfg, name)
        parts, start = [], 0
        for n in qkv_segments(cfg):
            a, b = rank_range(n, rank, world)
            parts.append(source[start + a:start + b])
            start += n
        if start != shape[0]:
            raise ShardError(f"in_proj_qkv/conv1d has {shape[0]} rows, the config says {start}")
        return torch.cat(parts, 0)
    if kind in ("colwise", "vocab"):
        a, b = rank_range(shape[0], rank, world)
        return source[a:b]
    if kind == "rowwise":
        a, b = rank_range(shape[1], rank, world)
        return source[:, a:b]
    raise ShardError(f"unknown split kind {kind!r}")


def _qkv_unit(cfg: ModelConfig, columns: int, name: str) -> int:
    """Output rows per column of a packed in_proj_qkv tensor: 1 (GPTQ qweight, scales) or 8 (packed words)."""
    rows = sum(qkv_segments(cfg))
    if rows not in (columns, 8 * columns):
        raise ShardError(f"{name}: {columns} output columns do not fit in_proj_qkv's {rows} rows (the config's "
                         f"linear-attention heads)")
    return rows // columns


def _take_packed_qkv(source, shape, rank: int, world: int, cfg: ModelConfig, name: str):
    """A packed in_proj_qkv's part for this rank: [q_r | k_r | v_r] along the outputs (dim 1), whole words."""
    import torch

    if name.endswith("g_idx"):  # over the inputs: every rank needs all of it
        return source[:]
    unit = _qkv_unit(cfg, shape[1], name)
    parts, start = [], 0
    for n in qkv_segments(cfg):
        if n % (world * 8):
            raise ShardError(f"{name}: {n} rows of one of q/k/v split over {world} ranks would cut a packed word "
                             f"of 8 values (each rank's part must be a multiple of 8 rows)")
        a, b = rank_range(n // unit, rank, world)
        parts.append(source[:, start + a:start + b])
        start += n // unit
    return torch.cat(parts, 1)


def split_dim(kind: str, name: str | None = None) -> int | None:
    """The dimension along which the ranks' parts concatenate back, or None if replicated. Packed tensors
    (GPTQ / AWQ, stored [inputs, outputs]): colwise along dim 1 (g_idx, over the inputs, replicated),
    rowwise along dim 0."""
    if name is not None and PACKED.search(name) and kind in ("colwise", "rowwise", "colwise_qkv"):
        if kind in ("colwise", "colwise_qkv"):
            return None if name.endswith("g_idx") else 1
        return 0
    return {"colwise": 0, "vocab": 0, "rowwise": 1, "colwise_qkv": 0}.get(kind)


def join(pieces: list, kind: str, cfg: ModelConfig, name: str | None = None):
    """The ranks' parts put back together (the inverse of ``take`` over every rank)."""
    import torch

    dim = split_dim(kind, name)
    if kind == "colwise_qkv" and dim is not None:
        unit = _qkv_unit(cfg, sum(p.shape[dim] for p in pieces), name or "in_proj_qkv") if dim == 1 else 1
        per = [n // unit // len(pieces) for n in qkv_segments(cfg)]
        segs = [p.split(per, dim) for p in pieces]
        return torch.cat([segs[r][i] for i in range(len(per)) for r in range(len(pieces))], dim)
    return pieces[0] if dim is None else torch.cat(pieces, dim=dim)
