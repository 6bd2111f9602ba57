"""The context a rank serves when `serve` is given no --max-context: the model's native context, bounded by what
fits the card (docs/service.md, "Default context").

  max context = --max-context                                    (bound "flag")
              = native, on CPU                                   (bound "native": host memory is not planned)
              = min(native, positions that fit this rank's card)  (bound "native" or "memory")

positions that fit are for one sequence, or for N together when `--max-concurrency N` is given; with neither flag the
context is chosen first (for one sequence), then how many sequences of it fit (engine/service/concurrency_default.py).

What fits is engine.memory_fit's arithmetic, the planner's own: the card's memory (this rank's share of it when two
ranks share one card), less what the rank holds once its weights (and vision tower) are loaded, less the runtime
reserve from the bundled engine's profile, less the linear-attention state of a sequence, divided by this rank's
K/V (and RoPE tables) per position. Stdlib only: the rank passes the card's figures in.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import memory_fit
from engine.core.config import ModelConfig
from engine.kernels import shapes

BOUNDS = ("native", "memory", "flag")


@dataclass(frozen=True)
class Card:
    """The figures of the rank's card the default needs: bytes it has for this rank and bytes already held."""

    capacity_bytes: float   # total memory x this rank's share of the card
    held_bytes: float       # allocated by this rank once weights (and the vision tower) are loaded
    name: str = ""


def kv_bytes_per_position(cfg: ModelConfig, world: int, dtype_bytes: int, kv_int8: bool) -> float:
    """This rank's K/V per position (full-attention layers and the MTP draft layers, its share of the KV heads)
    plus the RoPE cos/sin tables' row (2 x rotary dim x dtype bytes)."""
    return slot_kv_bytes_per_position(cfg, world, dtype_bytes, kv_int8) + rope_bytes_per_position(cfg, dtype_bytes)


def slot_kv_bytes_per_position(cfg: ModelConfig, world: int, dtype_bytes: int, kv_int8: bool) -> float:
    """This rank's K/V per position of one sequence slot (full-attention layers and the MTP draft layers, its share
    of the KV heads): what every slot holds."""
    layers = cfg.layer_types.count("full_attention") + cfg.mtp_layers
    element = (memory_fit.kv_element_bytes(1, memory_fit.INT8_SCALE_BYTES, cfg.head_dim) if kv_int8
               else float(dtype_bytes))
    return memory_fit.kv_bytes_per_position(layers, cfg.num_kv_heads // world, cfg.head_dim, element)


def batch_workspace_bytes_per_position(cfg: ModelConfig, world: int, dtype_bytes: int, kv_int8: bool) -> float:
    """The batched step's transient memory per row and position (N > 1 only, on a GPU: the ranks this plan is for).
    Where the attention kernel holds the shape (engine.kernels.shapes), it reads each row's slot in place and its
    partials are per row, not per position: 0. Otherwise the torch form (engine/model/attention.py decode_rows)
    gathers each row's window of K and V out of its slot ([kv heads, W, head dim] in the compute dtype, and with an
    int8 cache the gathered codes and scales before they are dequantised), then the float32 scores and their
    softmax and the probabilities in the compute dtype ([heads, W]) and the row's float32 mask, one attention layer
    at a time. Not held between steps, but a rank must have room for it with every slot at its last position, so
    each slot is planned with it."""
    if not cfg.layer_types.count("full_attention"):
        return 0.0
    kv, heads, hd = cfg.num_kv_heads // world, cfg.num_heads // world, cfg.head_dim
    if shapes.attention_supported(hd, heads, kv) and shapes.rotary_supported(cfg.rotary_dim or hd, hd):
        return 0.0
    gathered = 2 * kv * hd * dtype_bytes + (2 * kv * (hd + memory_fit.INT8_SCALE_BYTES) if kv_int8 else 0)
    return gathered + heads * (4 + 4 + dtype_bytes) + 4


def rope_bytes_per_position(cfg: ModelConfig, dtype_bytes: int) -> float:
    """The RoPE cos/sin tables' row (2 x rotary dim x dtype bytes): one table for all the slots."""
    return 2 * cfg.rotary_dim * dtype_bytes


def state_bytes(cfg: ModelConfig, world: int, dtype_bytes: int) -> float:
    """This rank's Gated DeltaNet state of one sequence (fp32 recurrent state, conv ring of the kernel's width)."""
    layers = cfg.layer_types.count("linear_attention")
    if not layers:
        return 0.0
    return memory_fit.linear_state_bytes(layers, cfg.linear_num_key_heads // world, cfg.linear_num_value_heads // world,
                                         cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                         cfg.linear_conv_kernel_dim, 4, dtype_bytes)


def choose(flag: int | None, cfg: ModelConfig, *, world: int, dtype_bytes: int, kv_int8: bool,
           card: Card | None, sequences: int = 1) -> dict:
    """{max_context, bound, why, native, fits}: ``card`` None means CPU. ``sequences``: the slots the context must
    fit in together (--max-concurrency given with no --max-context; the default concurrency is chosen after the
    context, for one sequence: engine/service/concurrency_default.py). Raises ValueError when a GPU rank has no
    room for even a short context (the message says what to change)."""
    native = int(cfg.max_position_embeddings)
    if flag is not None:
        return {"max_context": flag, "bound": "flag", "native": native, "fits": None,
                "why": f"--max-context {flag}" + (f" (the model's native context is {native})" if native else "")}
    if card is None:
        return {"max_context": native, "bound": "native", "native": native, "fits": None,
                "why": f"the model's native context ({native}); on CPU host memory is not planned"}
    reserve_gb, reserve_source = memory_fit.runtime_reserve()
    # S slots: S x (K/V per position) + one RoPE row per position; S x the linear-attention state
    per_position = (slot_kv_bytes_per_position(cfg, world, dtype_bytes, kv_int8)
                    + rope_bytes_per_position(cfg, dtype_bytes) / sequences
                    + (batch_workspace_bytes_per_position(cfg, world, dtype_bytes, kv_int8) if sequences > 1 else 0))
    free = memory_fit.free_for_context(card.capacity_bytes, card.held_bytes, reserve_gb * memory_fit.GB,
                                       state_bytes(cfg, world, dtype_bytes), sequences)
    fits = memory_fit.positions_that_fit(free, per_position, sequences)
    each = f" for each of {sequences} sequences (--max-concurrency {sequences})" if sequences > 1 else ""
    arithmetic = (f"({card.capacity_bytes / 1e9:.2f} GB of {card.name or 'the card'} - {card.held_bytes / 1e9:.2f} GB "
                  f"held - {reserve_gb:g} GB runtime reserve - linear-attention state{'s' if sequences > 1 else ''}) / "
                  f"{sequences * per_position / 1024:.1f} KiB a position = {fits} positions{each}")
    if fits < 2:
        raise ValueError(f"no room for a context on this card: {arithmetic}; give "
                         + ("a smaller --max-concurrency, " if sequences > 1 else "")
                         + "--max-context, --kv-cache-dtype int8 or a smaller (4-bit) checkpoint, or a card with more "
                           "memory")
    if fits >= native:
        return {"max_context": native, "bound": "native", "native": native, "fits": fits,
                "why": f"the model's native context ({native}) fits: {arithmetic}"}
    return {"max_context": fits, "bound": "memory", "native": native, "fits": fits,
            "why": f"the model's native {native} positions do not fit: {arithmetic} (runtime reserve: "
                   f"{reserve_source.split(' (')[0]})"}
