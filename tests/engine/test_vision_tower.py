"""The vision tower (engine.vision.tower) judged against transformers' Qwen3_5VisionModel on the same random
weights: the merged embeddings of images of several grids, in float32, within 1e-5 of the largest value."""

from __future__ import annotations

import pytest
import torch

from engine.vision import config as vconfig
from engine.vision.tower import Tower

VISION = dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64)


@pytest.fixture(scope="module")
def pair(one_thread):
    import transformers

    torch.manual_seed(11)
    hf = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel(
        transformers.Qwen3_5VisionConfig(**VISION)).eval()
    with torch.no_grad():
        for p in hf.parameters():  # spread every weight (the default init leaves biases 0, norms 1)
            p.copy_(torch.randn_like(p) * (0.2 if p.ndim > 1 else 0.5))
    cfg = vconfig.from_dict({"model_type": "qwen3_5", "vision_config": VISION, "text_config": {"hidden_size": 48}})
    tower = Tower(cfg)
    for k, t in hf.state_dict().items():
        tower.w[k].copy_(t)
    return hf, tower, cfg


@pytest.mark.parametrize("grid", [(1, 4, 6), (1, 8, 8), (1, 2, 12), (1, 16, 4)])
def test_tower_equals_transformers(pair, grid):
    hf, tower, cfg = pair
    n = grid[1] * grid[2]
    pv = torch.randn(n, cfg.patch_dim, generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        ref = hf(pv, grid_thw=torch.tensor([grid])).pooler_output
    got = tower.forward(pv, grid)
    assert got.shape == (n // 4, 48)
    err = (got - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item(), f"max |diff| {err} of {ref.abs().max().item()}"


def test_two_images_at_once_in_transformers_are_two_calls_here(pair):
    """transformers packs images into one call with per-image attention; the tower encodes them one by one."""
    hf, tower, cfg = pair
    a, b = (1, 4, 6), (1, 6, 4)
    pa, pb = torch.randn(24, cfg.patch_dim), torch.randn(24, cfg.patch_dim)
    with torch.no_grad():
        ref = hf(torch.cat([pa, pb]), grid_thw=torch.tensor([a, b])).pooler_output
    got = torch.cat([tower.forward(pa, a), tower.forward(pb, b)])
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_a_grid_that_does_not_fit_the_pixels_is_refused(pair):
    _, tower, cfg = pair
    with pytest.raises(ValueError, match="do not fit the grid"):
        tower.forward(torch.zeros(10, cfg.patch_dim), (1, 4, 4))


def test_param_count_counts_every_tensor(pair):
    hf, _, cfg = pair
    assert cfg.param_count() == sum(p.numel() for p in hf.parameters())
