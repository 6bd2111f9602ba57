"""A prefill chunk's attention over the cached prefix and itself, without a [T, prefix + T] mask.

Query i of a chunk at positions pos0..pos0+T-1 sees keys 0..pos0+i: causal, aligned to the lower right of the
[T, pos0 + T] score matrix. Handing torch that rule as a boolean mask sends a grouped-query attention (27B: 24
query heads on 4 KV heads) to the math backend, which materialises the float32 scores: 12 heads x 2048 x 262,144
x 4 bytes = 25 GB per rank for one chunk at the end of a 256K prompt (one H200, 2026-12-02: the card's memory
filled, the 262K prompt took 247 s). Here the rule goes as torch's lower-right causal bias, which runs in the
flash kernel (GQA native) where it can; on cards without it (the V100 runs the memory-efficient kernel, which
takes no GQA) each KV head's group of query heads goes on its own, the KV head expanded for that group only.
CPU keeps the boolean mask (the math backend, float32: the tests' exact path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _flash_ok(q: torch.Tensor) -> bool:
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and torch.cuda.get_device_capability(q.device) >= (8, 0) and q.shape[-1] <= 256)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos0: int, per_group: bool | None = None):
    """q [1, H, T, hd], keys / values [1, KV, pos0 + T, hd] -> [1, H, T, hd]. ``per_group``: force (True) or forbid
    (False) the one-KV-head-at-a-time form (default: where flash cannot run)."""
    t, h, kv = q.shape[2], q.shape[1], keys.shape[1]
    gqa = h != kv
    if pos0 == 0 and t > 1:  # plainly causal: no bias at all
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
    if t == 1 or q.device.type != "cuda":
        mask = None if t == 1 else torch.ones(t, pos0 + t, dtype=torch.bool, device=q.device).tril(diagonal=pos0)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(t, pos0 + t)
    if per_group is None:
        per_group = gqa and not _flash_ok(q)
    if not per_group:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, enable_gqa=gqa)
    g = h // kv
    out = torch.empty_like(q)
    for j in range(kv):  # one KV head's query heads; its K/V expanded for them alone
        kj = keys[:, j:j + 1].expand(1, g, *keys.shape[2:]).contiguous()
        vj = values[:, j:j + 1].expand(1, g, *values.shape[2:]).contiguous()
        out[:, j * g:(j + 1) * g] = F.scaled_dot_product_attention(q[:, j * g:(j + 1) * g], kj, vj, attn_mask=bias)
    return out
