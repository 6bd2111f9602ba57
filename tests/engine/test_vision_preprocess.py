"""Image preprocessing (engine.vision.preprocess) judged against transformers' Qwen2-VL processor (the Pillow
backend the Qwen3.5 family maps to): the same grid and token count, pixel_values within 1e-5, for images that
are resized up, down, not at all, and of every aspect."""

from __future__ import annotations

import pytest

from engine.vision.config import ImageRules
from engine.vision.preprocess import ImageSizeError, pixels, smart_resize, token_count

RULES = ImageRules(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 64, patch_size=16, temporal_patch_size=2,
                   merge_size=2, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))


def _image(w: int, h: int, seed: int, mode: str = "RGB"):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    return img.convert(mode)


@pytest.mark.parametrize("w,h,mode", [(64, 64, "RGB"), (100, 37, "RGB"), (300, 500, "RGB"), (17, 90, "RGBA"),
                                      (640, 96, "L"), (512, 512, "P")])
def test_pixels_equal_the_transformers_processor(w, h, mode):
    import numpy as np
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    img = _image(w, h, w * h, mode)
    ref = Qwen2VLImageProcessorPil(size={"shortest_edge": RULES.min_pixels, "longest_edge": RULES.max_pixels},
                                   patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                   image_std=[0.5] * 3)(images=[img], return_tensors="np")
    got = pixels(img, RULES)
    assert tuple(ref["image_grid_thw"][0]) == got.grid
    assert ref["pixel_values"].shape == got.values.shape
    assert np.abs(ref["pixel_values"] - got.values).max() <= 1e-5
    assert got.tokens(2) == token_count(h, w, RULES) == int(np.prod(ref["image_grid_thw"][0])) // 4


def test_smart_resize_keeps_the_limits():
    assert smart_resize(1024, 1024, 32, 65536, 16777216) == (1024, 1024)
    h, w = smart_resize(10000, 3000, 32, 65536, 1 << 20)
    assert h % 32 == 0 and w % 32 == 0 and h * w <= 1 << 20
    h, w = smart_resize(10, 20, 32, 65536, 1 << 20)
    assert h * w >= 65536


def test_an_aspect_ratio_over_200_is_refused():
    with pytest.raises(ImageSizeError, match="aspect ratio"):
        smart_resize(10, 2010, 32, 1024, 1 << 20)
