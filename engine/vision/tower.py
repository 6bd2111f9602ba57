"""Qwen3.5's vision tower: pixel patches of one image -> embeddings in the language model's hidden size.

  patch embed   a linear map of each patch's C x t x p x p values (the checkpoint's Conv3d, stride = kernel)
  + positions   the learned square grid of positions resampled bilinearly (corners aligned) to the image's grid
  blocks        pre-LayerNorm ViT blocks: attention over all patches of the image (no mask) with a 2D rotary
                (half the rotated pairs turn with the patch's row, half with its column), GELU(tanh) MLP
  merger        LayerNorm, then each merge x merge block of patches concatenated -> Linear, GELU, Linear

Patches arrive block by block (engine.vision.preprocess), so the merger's blocks are consecutive rows. Every
rank holds the whole tower (replicated under TP2: about 0.4 B parameters for the 27B model's, against 27 B in
the decoder; FACTS: the field's engine replicates it too) and encodes every image itself, so the two ranks'
embeddings are the same bits and the lockstep check compares a hash of them (engine.vision.prompt).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.vision.config import VisionConfig

PREFIX = "model.visual."  # where the tower's tensors sit in a Qwen3.5 checkpoint


def tensor_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tower by its checkpoint name (without PREFIX), with its shape."""
    d, f, m = cfg.hidden_size, cfg.intermediate_size, cfg.merge_unit * cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (d, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
        "patch_embed.proj.bias": (d,), "pos_embed.weight": (cfg.num_position_embeddings, d)}
    for i in range(cfg.depth):
        b = f"blocks.{i}."
        out.update({b + "norm1.weight": (d,), b + "norm1.bias": (d,), b + "norm2.weight": (d,), b + "norm2.bias": (d,),
                    b + "attn.qkv.weight": (3 * d, d), b + "attn.qkv.bias": (3 * d,), b + "attn.proj.weight": (d, d),
                    b + "attn.proj.bias": (d,), b + "mlp.linear_fc1.weight": (f, d), b + "mlp.linear_fc1.bias": (f,),
                    b + "mlp.linear_fc2.weight": (d, f), b + "mlp.linear_fc2.bias": (d,)})
    out.update({"merger.norm.weight": (d,), "merger.norm.bias": (d,), "merger.linear_fc1.weight": (m, m),
                "merger.linear_fc1.bias": (m,), "merger.linear_fc2.weight": (cfg.out_hidden_size, m),
                "merger.linear_fc2.bias": (cfg.out_hidden_size,)})
    return out


def block_order(gh: int, gw: int, merge: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row [N], col [N]) of each patch in the order the patches arrive: merge x merge blocks, row by row."""
    idx = torch.arange(gh * gw, device=device)
    in_col, in_row = idx % merge, (idx // merge) % merge
    block = idx // (merge * merge)
    return (block // (gw // merge)) * merge + in_row, (block % (gw // merge)) * merge + in_col


def _taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (corners aligned) of ``index`` on an axis of ``size`` into a table of ``side``: [N, 2] each."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    lo = torch.floor(src)
    taps = lo.long()[:, None] + torch.arange(2, device=index.device)
    weights = (1 - (src[:, None] - lo[:, None] - torch.arange(2, device=index.device)).abs()).clamp(min=0)
    return taps.clamp(0, side - 1), weights


class Tower:
    """The tower's weights (checkpoint names without PREFIX) on one device, and its forward for one image."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.w = {k: torch.empty(s, dtype=dtype, device=self.device) for k, s in tensor_shapes(cfg).items()}
        hd = cfg.head_dim // 2  # each of row and column turns head_dim / 4 frequency pairs
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=self.device) / hd))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.w.values())

    def positions(self, gh: int, gw: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(learned position embeddings [N, D] in float32, rotary cos [N, hd], sin [N, hd]) of a gh x gw grid."""
        cfg = self.cfg
        side = int(round(cfg.num_position_embeddings ** 0.5))
        row, col = block_order(gh, gw, cfg.spatial_merge_size, self.device)
        rt, rw = _taps(row, gh, side)
        ct, cw = _taps(col, gw, side)
        idx = (rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4)  # [N, 4] taps into the table
        wt = (rw[:, :, None] * cw[:, None, :]).reshape(-1, 4)
        pos = (F.embedding(idx, self.w["pos_embed.weight"]) * wt[:, :, None]).sum(1)  # [N, D] float32
        f = torch.cat([row[:, None].float() * self.inv_freq, col[:, None].float() * self.inv_freq], -1)  # [N, hd/2]
        emb = torch.cat([f, f], -1)  # [N, hd]
        return pos, emb.cos(), emb.sin()

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """pixel_values [N, patch_dim] (any float dtype) of one image with grid (1, gh, gw) -> [N / merge^2,
        out_hidden_size] in the tower's dtype."""
        cfg, w = self.cfg, self.w
        t, gh, gw = grid
        if t != 1 or pixel_values.shape != (gh * gw, cfg.patch_dim):
            raise ValueError(f"pixel values {tuple(pixel_values.shape)} do not fit the grid {grid}")
        d, heads, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        x = F.linear(pixel_values.to(self.device, self.dtype), w["patch_embed.proj.weight"].view(d, -1),
                     w["patch_embed.proj.bias"])  # [N, D]
        pos, cos, sin = self.positions(gh, gw)
        x = x + pos.to(self.dtype)
        cos, sin = cos[:, None], sin[:, None]  # [N, 1, hd] over the heads
        n = x.shape[0]
        act = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"
        for i in range(cfg.depth):
            b = f"blocks.{i}."
            h = F.layer_norm(x, (d,), w[b + "norm1.weight"], w[b + "norm1.bias"], 1e-6)
            q, k, v = F.linear(h, w[b + "attn.qkv.weight"], w[b + "attn.qkv.bias"]).view(n, 3, heads, hd).unbind(1)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)  # [N, H, hd]
            a = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None])  # [1, H, N, hd]
            a = a[0].transpose(0, 1).reshape(n, d)
            x = x + F.linear(a, w[b + "attn.proj.weight"], w[b + "attn.proj.bias"])
            h = F.layer_norm(x, (d,), w[b + "norm2.weight"], w[b + "norm2.bias"], 1e-6)
            h = F.gelu(F.linear(h, w[b + "mlp.linear_fc1.weight"], w[b + "mlp.linear_fc1.bias"]), approximate=act)
            x = x + F.linear(h, w[b + "mlp.linear_fc2.weight"], w[b + "mlp.linear_fc2.bias"])
        x = F.layer_norm(x, (d,), w["merger.norm.weight"], w["merger.norm.bias"], 1e-6).view(-1, cfg.merge_unit * d)
        x = F.gelu(F.linear(x, w["merger.linear_fc1.weight"], w["merger.linear_fc1.bias"]))
        return F.linear(x, w["merger.linear_fc2.weight"], w["merger.linear_fc2.bias"])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The tower's rotary in float32 (as transformers applies it), rounded back to x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    return (xf * cos + torch.cat((-xf[..., half:], xf[..., :half]), -1) * sin).to(x.dtype)
