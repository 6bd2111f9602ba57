"""The int8 K/V cache (``--kv-cache-dtype int8``): one float32 scale per position and kv head.

    scale = max |x| / 127 over the head's dimensions,   q = clamp(floor(x / scale + 0.5), -127, 127)

written once when a position's K/V are made (prefill or the decode step) and dequantised where they are
read (x ~ q * scale, in the model's dtype). The fused attention kernel (engine.kernels.decode.decode_attention) does the same
arithmetic in registers, so the plain blocks and the kernel see the same cache. Half the bytes of a 16-bit
cache (plus 4 bytes per position and head for the scale: 1.6 % at head dim 256): at long context the decode
step reads K/V at the same rate, so the attention part halves.
"""

from __future__ import annotations

import torch

KV_DTYPES = ("auto", "int8")  # auto: the model's dtype


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., hd] -> (int8 [..., hd], float32 scale [...])."""
    xf = x.float()
    scale = xf.abs().amax(-1).clamp_min(1e-30) / 127.0
    q = torch.floor(xf / scale[..., None] + 0.5).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


def write(cache: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, pos0: int | None = None,
          pos: torch.Tensor | None = None) -> None:
    """Store x [1, kv, T, hd] at positions pos0.. (prefill) or at the device position ``pos`` (one token)."""
    q, s = quantize(x)
    if pos is None:
        t = x.shape[2]
        cache[:, :, pos0:pos0 + t] = q
        scales[:, :, pos0:pos0 + t] = s
    else:
        cache.index_copy_(2, pos, q)
        scales.index_copy_(2, pos, s)
