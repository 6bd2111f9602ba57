"""The packed 4-bit words the int4 kernels read (engine.kernels.gemv_int4), in torch: eight values to an int32 word,
AutoAWQ's nibble order, and the tile a held matrix's words are grouped in on a GPU (engine.core.quant holds the
packed weight and says how a checkpoint's layouts become the held one)."""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packing: nibble i of a word holds column AWQ_ORDER[i]
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of a word sits in nibble AWQ_REVERSE[j]
TILE_WORDS = 16  # words per row of one held tile (128 inputs: a GPTQ / AWQ group of 128, or whole smaller groups)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble j at bits 4 j


def unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., M] -> uint8 [..., 8 M]: nibble j of word m is value 8 m + j. Through the words' bytes (little-
    endian: byte b holds nibbles 2 b and 2 b + 1), a quarter of the work of shifting int32s."""
    b = words.to(torch.int32).contiguous().view(torch.uint8)  # [..., 4 M]
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*words.shape[:-1], words.shape[-1] * 8)


def pack(values: torch.Tensor) -> torch.Tensor:
    """int [..., 8 M] in [0, 16) -> int32 [..., M], the inverse of unpack."""
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, 8) << _SHIFTS.to(values.device).to(torch.int64)
    w = v.sum(-1)  # disjoint bits: the sum is the OR
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)


def awq_to_natural(words: torch.Tensor) -> torch.Tensor:
    """AWQ-ordered words [..., M] -> the same values unpacked in column order [..., 8 M]."""
    v = unpack(words).reshape(*words.shape[:-1], -1, 8)
    return v[..., list(AWQ_REVERSE)].reshape(*words.shape[:-1], -1)
