"""How each Hugging Face tensor is split under tensor parallelism: one table, one slicing function.

  colwise     split rows (dim 0): q/k/v, gate/up and their biases: each rank gets whole heads / columns
  rowwise     split columns (dim 1): o_proj, down_proj: each rank's partial output is summed by an allreduce
  vocab       split rows (dim 0) of the output head: logits are gathered back in rank order
  replicated  every rank holds all of it: embeddings, norms, q/k norms, o/down biases (added once, by rank 0)
"""

from __future__ import annotations

import re

from engine.core.config import ModelConfig

RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^model\.embed_tokens\.weight$"), "replicated"),
    (re.compile(r"^model\.norm\.weight$"), "replicated"),
    (re.compile(r"^lm_head\.weight$"), "vocab"),
    (re.compile(r"^model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight$"), "replicated"),
    (re.compile(r"^model\.layers\.\d+\.self_attn\.(q|k|v)_proj\.(weight|bias|qweight|qzeros|scales|g_idx)$"), "colwise"),
    (re.compile(r"^model\.layers\.\d+\.self_attn\.o_proj\.(weight|qweight|qzeros|scales|g_idx)$"), "rowwise"),
    (re.compile(r"^model\.layers\.\d+\.self_attn\.o_proj\.bias$"), "replicated"),
    (re.compile(r"^model\.layers\.\d+\.self_attn\.(q_norm|k_norm)\.weight$"), "replicated"),
    (re.compile(r"^model\.layers\.\d+\.mlp\.(gate|up)_proj\.(weight|bias|qweight|qzeros|scales|g_idx)$"), "colwise"),
    (re.compile(r"^model\.layers\.\d+\.mlp\.down_proj\.(weight|qweight|qzeros|scales|g_idx)$"), "rowwise"),
    (re.compile(r"^model\.layers\.\d+\.mlp\.down_proj\.bias$"), "replicated"),
]

# GPTQ / AWQ tensors (engine.core.quant): stored [inputs, outputs], so their split dims are the dense ones' swapped
PACKED = re.compile(r"\.(qweight|qzeros|scales|g_idx)$")

# Tensors some checkpoints carry that the decoder recomputes itself.
IGNORED = re.compile(r"(rotary_emb\.inv_freq)$")


class ShardError(ValueError):
    """A model that cannot be split this way, with the reason."""


def kind_of(name: str) -> str:
    for pattern, kind in RULES:
        if pattern.match(name):
            return kind
    raise ShardError(f"tensor {name!r} is not part of a Llama/Qwen2/Qwen3 dense decoder; refusing to guess "
                     f"how to split it")


def check_divisible(cfg: ModelConfig, world: int) -> None:
    """Refuse shapes that do not divide by ``world``, naming each one."""
    problems = []
    for label, n in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                     ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)):
        if n % world:
            problems.append(f"{label} = {n} is not divisible by {world}")
    if problems:
        raise ShardError("cannot split this model over " + f"{world} ranks: " + "; ".join(problems))


def rank_range(length: int, rank: int, world: int) -> tuple[int, int]:
    part = length // world
    return rank * part, (rank + 1) * part


def take(source, kind: str, rank: int, world: int, name: str | None = None):
    """This rank's part of ``source`` (a tensor or a safetensors slice, read lazily). ``name``: the tensor's
    name, which says whether it is packed (split along split_dim's dimension, in whole words and groups)."""
    if kind == "replicated" or world == 1:
        return source[:]
    if kind not in ("colwise", "vocab", "rowwise"):
        raise ShardError(f"unknown split kind {kind!r}")
    shape = source.get_shape() if hasattr(source, "get_shape") else list(source.shape)
    dim = split_dim(kind, name)
    if dim is None:
        return source[:]
    if name is not None and PACKED.search(name) and shape[dim] % world:
        what = "groups" if dim == 0 and not name.endswith("g_idx") else "values or packed words"
        raise ShardError(f"{name}: its {shape[dim]} {what} along dim {dim} do not split into {world} equal parts: "
                         f"a split would cut a packed word or a quantisation group")
    a, b = rank_range(shape[dim], rank, world)
    return source[a:b] if dim == 0 else source[:, a:b]


def split_dim(kind: str, name: str | None = None) -> int | None:
    """The dimension along which the ranks' parts concatenate back, or None if replicated. Packed tensors
    (GPTQ / AWQ, stored [inputs, outputs]): colwise along dim 1 (g_idx, over the inputs, replicated),
    rowwise along dim 0."""
    if name is not None and PACKED.search(name) and kind in ("colwise", "rowwise"):
        if kind == "colwise":
            return None if name.endswith("g_idx") else 1
        return 0
    return {"colwise": 0, "vocab": 0, "rowwise": 1}.get(kind)
