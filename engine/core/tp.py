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
    (re.compile(r"^model\.layers\.\d+\.self_attn\.(q|k|v)_proj\.(weight|bias)$"), "colwise"),
    (re.compile(r"^model\.layers\.\d+\.self_attn\.o_proj\.weight$"), "rowwise"),
    (re.compile(r"^model\.layers\.\d+\.self_attn\.o_proj\.bias$"), "replicated"),
    (re.compile(r"^model\.layers\.\d+\.self_attn\.(q_norm|k_norm)\.weight$"), "replicated"),
    (re.compile(r"^model\.layers\.\d+\.mlp\.(gate|up)_proj\.(weight|bias)$"), "colwise"),
    (re.compile(r"^model\.layers\.\d+\.mlp\.down_proj\.weight$"), "rowwise"),
    (re.compile(r"^model\.layers\.\d+\.mlp\.down_proj\.bias$"), "replicated"),
]

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


def take(source, kind: str, rank: int, world: int):
    """This rank's part of ``source`` (a tensor or a safetensors slice, read lazily)."""
    if kind == "replicated" or world == 1:
        return source[:]
    shape = source.get_shape() if hasattr(source, "get_shape") else list(source.shape)
    if kind in ("colwise", "vocab"):
        a, b = rank_range(shape[0], rank, world)
        return source[a:b]
    if kind == "rowwise":
        a, b = rank_range(shape[1], rank, world)
        return source[:, a:b]
    raise ShardError(f"unknown split kind {kind!r}")


def split_dim(kind: str) -> int | None:
    """The dimension along which the ranks' parts concatenate back, or None if replicated."""
    return {"colwise": 0, "vocab": 0, "rowwise": 1}.get(kind)
