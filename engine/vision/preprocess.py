"""An image -> the tower's input, by the Qwen2-VL processor's rules (which the Qwen3.5 family uses):

  1. RGB; resize (bicubic, Pillow) to (H, W) = smart_resize: both multiples of patch x merge (32 for 16-pixel
     patches merged 2 x 2), the area within [min_pixels, max_pixels], the aspect ratio kept as closely as that
     allows;
  2. values x 1/255, then (x - mean) / std per channel;
  3. cut into patches of patch x patch pixels, ordered block by block (each merge x merge block of patches
     together, the blocks row by row), every patch repeated temporal_patch_size times (a still image is a
     one-frame video): pixel_values [H/p x W/p, C x t x p x p] float32, grid (1, H/p, W/p).

The image then takes grid_h x grid_w / merge^2 tokens in the prompt. Checked against transformers' own
processor (Qwen2VLImageProcessorPil) in tests/engine/test_vision_preprocess.py.
"""

from __future__ import annotations

import dataclasses
import math

from engine.vision.config import ImageRules


class ImageSizeError(ValueError):
    """An image whose shape the processor refuses (aspect ratio over 200, or empty)."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(H, W): multiples of ``factor``, H x W within [min_pixels, max_pixels], the aspect ratio about kept."""
    if height < 1 or width < 1:
        raise ImageSizeError(f"an image of {width}x{height} pixels has nothing to see")
    if max(height, width) / min(height, width) > 200:
        raise ImageSizeError(f"an image of {width}x{height} pixels: the aspect ratio must be at most 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclasses.dataclass(frozen=True)
class Pixels:
    values: object  # numpy float32 [patches, patch_dim]
    grid: tuple[int, int, int]  # (t, h, w) in patches

    def tokens(self, merge: int) -> int:
        """Image tokens in the prompt: one per merge x merge block of patches."""
        t, h, w = self.grid
        return t * h * w // (merge * merge)


def token_count(height: int, width: int, rules: ImageRules) -> int:
    """Tokens an image of this size takes, without decoding it (the admission check and the planner)."""
    h, w = smart_resize(height, width, rules.factor, rules.min_pixels, rules.max_pixels)
    return (h // rules.patch_size) * (w // rules.patch_size) // (rules.merge_size ** 2)


def pixels(image, rules: ImageRules) -> Pixels:
    """A decoded Pillow image -> the tower's input."""
    import numpy as np
    from PIL import Image

    img = image.convert("RGB")
    h, w = smart_resize(img.height, img.width, rules.factor, rules.min_pixels, rules.max_pixels)
    if (img.height, img.width) != (h, w):
        img = img.resize((w, h), resample=Image.Resampling(rules.resample))
    x = np.asarray(img).astype(np.float64) * rules.rescale  # [H, W, C]; the processor rescales in float64
    x = x.astype(np.float32)
    mean, std = np.asarray(rules.mean, dtype=np.float32), np.asarray(rules.std, dtype=np.float32)
    x = ((x - mean) / std).transpose(2, 0, 1)  # [C, H, W]
    p, m, t = rules.patch_size, rules.merge_size, rules.temporal_patch_size
    c = x.shape[0]
    gh, gw = h // p, w // p
    x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # [bh, bw, mh, mw, C, p, p]
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))  # the still image repeated in time
    return Pixels(np.ascontiguousarray(x.reshape(gh * gw, c * t * p * p), dtype=np.float32), (1, gh, gw))


def decode(data: bytes, max_pixels: int):
    """Image file bytes (PNG, JPEG, WebP) -> a decoded Pillow image; ImageSizeError past ``max_pixels`` (read
    from the header, before any pixel is decoded) or for bytes Pillow cannot read."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > max_pixels:
            raise ImageSizeError(f"an image of {img.width}x{img.height} pixels is over the limit of {max_pixels}")
        img.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        if isinstance(e, ImageSizeError):
            raise
        raise ImageSizeError(f"the image cannot be decoded: {e}") from None
    return img
