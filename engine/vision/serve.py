"""Images between the service's processes: the proxy (or `generate --tp 2`) sends each image as base64 of
its file bytes with the request, after the prompt's image-pad tokens were expanded to each image's count;
every rank decodes and preprocesses the same bytes the same way (engine.vision.preprocess), encodes them with
its own replicated tower and checks the tower's output with its peer (``lockstep_hash``)."""

from __future__ import annotations

import base64

from engine.vision import preprocess
from engine.vision.config import ImageRules, VisionConfig

DECODE_LIMIT_PIXELS = 1 << 28  # what a rank decodes at most; the proxy's --max-image-pixels is the user's limit


def wire(data: list[bytes]) -> list[str]:
    return [base64.b64encode(b).decode("ascii") for b in data]


def expand_prompt(ids: list[int], data: list[bytes], cfg: VisionConfig, rules: ImageRules) -> list[int]:
    """A prompt with one image-pad token per image -> each image's token count of them (from its header's size)."""
    from engine.vision.prompt import ImagePromptError

    pads = [i for i, t in enumerate(ids) if t == cfg.image_token_id]
    if len(pads) != len(data):
        raise ImagePromptError(f"the prompt holds {len(pads)} image-pad token(s) (id {cfg.image_token_id}) for "
                               f"{len(data)} image(s): put one where each image goes, e.g. "
                               "<|vision_start|><|image_pad|><|vision_end|>")
    out, last = [], 0
    for i, b in zip(pads, data):
        img = preprocess.decode(b, DECODE_LIMIT_PIXELS)
        out += ids[last:i] + [cfg.image_token_id] * preprocess.token_count(img.height, img.width, rules)
        last = i + 1
    return out + ids[last:]


def begin(vision, req: dict, spec_tokens: int) -> tuple[list[int], int]:
    """A rank's request -> (the ids to run, the draft tokens it runs with). A request with images runs without
    speculation (the MTP draft layer embeds the prompt's own ids, which are key ids at an image's tokens)."""
    ids = list(req["prompt_ids"])
    images = req.get("images") or []
    if vision is None:
        if images:
            raise ValueError("images are not served here: the model has no vision tower, or the service runs "
                             "with --no-vision")
        return ids, spec_tokens
    pix = [preprocess.pixels(preprocess.decode(base64.b64decode(s), DECODE_LIMIT_PIXELS), vision.rules)
           for s in images]
    return vision.begin(ids, pix), 0 if pix else spec_tokens


def lockstep_hash(vision) -> int:
    """The tower outputs encoded since the last call, folded into 60 bits (0 when none): the rank XORs it into
    its prefill record's 63-bit hash, so a rank whose tower gave other bits fails the check before any token."""
    if vision is None or not vision.encoded:
        return 0
    h = 0
    for _, out_hash in vision.encoded:
        h ^= int(out_hash[:15], 16)
    vision.encoded = []
    return h


def health(vision, model_has_tower: bool) -> dict:
    """What /health says of vision: on (with the tower's bytes and dtype), off by --no-vision, or absent."""
    if vision is not None:
        return {"vision": "on", "tower_bytes": vision.tower.nbytes(), "encoder_cache_images": len(vision.cache)}
    return {"vision": "off" if model_has_tower else "absent"}
