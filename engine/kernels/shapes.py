"""The shapes the fused decode kernels hold, stdlib only: the model's blocks ask them which path runs (through
engine.kernels.decode, which re-exports them), and the control plane's memory plan asks them whether the batched
step copies each row's window (the torch form) or reads it in place (the kernel): engine/service/context_default.py."""

from __future__ import annotations


def attention_supported(hd: int, n_heads: int, n_kv: int) -> bool:
    """Shapes decode_attention handles: a power-of-two head dimension of 32 or more (Llama, Qwen: 64, 128)
    and whole groups of query heads per kv head. Others run the plain attention (with the Triton GEMVs)."""
    return hd >= 32 and hd & (hd - 1) == 0 and n_heads % n_kv == 0


def rotary_supported(rot: int, hd: int) -> bool:
    """A partial rotary the kernel's halves can hold: the rotary pairs inside the first half of the head."""
    return rot == hd or (rot % 2 == 0 and rot // 2 <= hd // 2)


def gdn_supported(dk: int, dv: int) -> bool:
    """Head sizes gdn_decode's kernel holds in one program: powers of two from 16 up to 256."""
    return all(16 <= n <= 256 and n & (n - 1) == 0 for n in (dk, dv))
