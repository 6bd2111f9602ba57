"""What every layer kind shares: the norm and RoPE arithmetic, the inputs of one decode step and of one prefill
chunk, the base class (weights, per-sequence state in a pool with a leading slot dimension), and the MLP every
layer holds unless the config's mlp_types names another kind (``dense``, DenseMLP: the SwiGLU MLP, weights w13 =
gate | up rows, w2; TP2: gate/up rows and down columns split, down into the exchange; decode: the torch form, or
(kernel choice "fused", engine.kernels.decode) norm + gate/up GEMV and SiLU(gate) * up + down GEMV)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from engine.core.config import ModelConfig
from engine.core.quant import matmul
from engine.kernels import decode


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zc: bool = False) -> torch.Tensor:
    # As Hugging Face does it: statistics in float32, result cast back before the weight multiply (Llama,
    # Qwen2/3); zero-centred (Qwen3.5, ``zc``): the weight applied as (1 + w) in float32, one rounding at the end.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if zc:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, zc: bool = False,
                 rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the batched step's rows (``rows``) in one kernel where the kernels run
    (engine.kernels.rows_norm.add_norm: rms_norm's rounding; the torch form is ten kernels a norm), else torch."""
    if rows and ROWS_KERNELS[0] and decode.runs_here(x.device):
        from engine.kernels import rows_norm

        return rows_norm.add_norm(x, delta, weight, eps, zc)
    x = x + delta
    return x, rms_norm(x, weight, eps, zc)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin on the first cos.shape[-1] of the last dimension (all of it, or the
    rotary part of a partial rotary factor); the rest passes through."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    xr, xp = x[..., :rot], x[..., rot:]
    return torch.cat((xr * cos + rotate_half(xr) * sin, xp), dim=-1)


# The batched step (Model.decode_batch) runs its attention and Gated DeltaNet mix by the one-row decode kernels'
# batched forms where the kernels run; False: their torch forms everywhere (a bench's comparison, never the service)
ROWS_KERNELS = [True]

@dataclasses.dataclass(frozen=True)
class Step:
    """One decode step's inputs, shared by every layer: device tensors only, so the step can be captured.
    ``fused``: the decoder's kernel choice is "fused" (each kind runs its Triton path where its shapes fit).
    ``slots``: a batched step (Model.decode_batch): row b is the sequence in slot slots[b] at position pos[b], and
    every tensor here has B rows; None: one row, the sequence in each layer's ``slot``."""
    pos: torch.Tensor  # [B] int64
    cos: torch.Tensor  # [B, rot]
    sin: torch.Tensor  # [B, rot]
    mask_bias: torch.Tensor  # [B, 1, 1, W] float32: 0 up to pos[b], -inf past it
    window: int  # attention reads cache positions [0, window)
    rank: int  # biases of row-parallel outputs are added on rank 0 only (the allreduce carries them once)
    fused: bool = False
    slots: torch.Tensor | None = None  # [B] int64, distinct


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One prefill chunk's inputs at positions pos0..pos0+T-1. ``kernels``: the model's kernel choice (None:
    eager); ``states``: the speculative verification's list that Gated DeltaNet layers append their per-position
    states to (engine.model.gdn)."""
    pos0: int
    cos: torch.Tensor  # [T, rot]
    sin: torch.Tensor  # [T, rot]
    rank: int = 0
    kernels: str | None = None
    states: list | None = None


class Block:
    """A half-layer (a mixer or an MLP): its weights are the attributes named in ``WEIGHTS``, its per-sequence
    state the pool tensors named in ``STATE`` (leading dimension: the sequence slot; ``slot``: the one decoding)."""

    WEIGHTS: tuple[str, ...] = ()
    STATE: tuple[str, ...] = ()
    slot = 0

    def weights(self) -> dict[str, torch.Tensor]:
        """The dense weight tensors, a mixer's MLP's included (packed matrices: ``matrices``)."""
        own = {k: t for k, t in self.matrices().items() if isinstance(t, torch.Tensor)}
        mlp = getattr(self, "mlp", None)
        if mlp is None:
            return own
        # the order the loaders and init_random walk (its random draws follow it): input norm, MLP, the mixer's own
        first = {k: own.pop(k) for k in ("input_norm",) if k in own}
        return {**first, **mlp.weights(), **own}

    def matrices(self) -> dict[str, object]:
        """Every weight of this block (its MLP's not), dense tensors or packed (engine.core.quant) matrices."""
        return {k: getattr(self, k) for k in self.WEIGHTS if getattr(self, k, None) is not None}

    def owner(self, name: str) -> Block:
        """The block that holds weight ``name``: this one, or its MLP (what the loaders fill)."""
        return self if name in self.WEIGHTS or not hasattr(self, "mlp") else self.mlp

    def state(self) -> list[torch.Tensor]:
        """The pools (every slot), as allocated by alloc_state; empty before it."""
        return [t for t in (getattr(self, k, None) for k in self.STATE) if t is not None]

    def reset_slot(self, slot: int) -> None:
        """Zero one slot's state in every pool (a freed slot; the next sequence there starts clean)."""
        for t in self.state():
            t[slot].zero_()

    def bias_once(self, bias: torch.Tensor | None, rank: int) -> torch.Tensor | None:
        return bias if rank == 0 else None


class DenseMLP(Block):
    kind = "dense"
    WEIGHTS = ("post_norm", "w13", "b13", "w2", "b2")

    def __init__(self, cfg: ModelConfig, world: int, e: dict, m: dict, ff: int | None = None):
        d = cfg.hidden_size
        self.eps, self.zc = cfg.rms_norm_eps, cfg.zero_centred_norm
        self.ff = (ff or cfg.intermediate_size) // world
        self.post_norm = torch.empty(d, **e)
        self.w13 = torch.empty(2 * self.ff, d, **m)  # rows: [gate | up] of this rank
        self.b13 = torch.empty(2 * self.ff, **e) if cfg.mlp_bias else None
        self.w2 = torch.empty(d, self.ff, **m)
        self.b2 = torch.empty(d, **e) if cfg.mlp_bias else None  # added by rank 0 only

    def prefill(self, h: torch.Tensor, rank: int) -> torch.Tensor:
        """h [B, T, D] (normed) -> down_proj partial."""
        return self.dense(h, self.w13, self.b13, self.w2, self.bias_once(self.b2, rank))

    @staticmethod
    def dense(h, w13, b13, w2, b2) -> torch.Tensor:
        gate, up = matmul(h, w13, b13).chunk(2, dim=-1)  # [B, T, ff] each
        return matmul(F.silu(gate) * up, w2, b2)

    def decode(self, x: torch.Tensor, delta: torch.Tensor, s: Step, send=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x, delta [1, 1, D] -> (x + delta, down_proj partial [1, 1, D]) (``send``: as FullAttention.decode's)."""
        return self.swiglu(x, delta, s, self.b13, self.bias_once(self.b2, s.rank), send)

    def swiglu(self, x, delta, s: Step, b13, b2, send=None):
        if s.fused and decode.runs_here(x.device):
            gu, x = decode.linear_norm(x, delta, self.post_norm, self.eps, self.w13, b13, zc=self.zc)
            return x, decode.linear_silu(gu, self.w2, b2, send=send)
        # the mixer's reduced output added, then the norm (one kernel for a batched step's rows)
        x, h = add_rms_norm(x, delta, self.post_norm, self.eps, self.zc, rows=s.slots is not None)
        gate, up = matmul(h, self.w13, b13).chunk(2, dim=-1)  # [rows, 1, ff] each
        return x, matmul(F.silu(gate) * up, self.w2, b2)
