"""Prompts with images in the batch loop (``serve --max-concurrency N`` > 1; docs/service.md, "Concurrent requests").

One request at a time rewrites the model's cos / sin tables with its multimodal rotary rows (engine.vision.mrope)
and hooks its image embeddings into the prefill (Model.embed_prompt) for the whole request. With several
sequences in their slots the tables are shared, so here a request with images keeps its own: the rotary rows of
its prompt positions (the image tokens' three-way rows, the plain row of every text position before them and
p + delta after) and its spans. While one of its prefill chunks runs, the model reads that request's rows and
embeddings; then the model's own (plain) tables and hook are back. Its decode steps turn position p with the plain
row p + delta (Model.decode_batch's ``rope_pos``), which is what the one-at-a-time tables hold there. The tower's
output hashes go into the next lockstep record (rank_batch._hand_out), as the one-at-a-time prefill record holds
them. The prefix cache sees key ids (engine.vision.prompt): a slot is reused only where the same images sit at the
same places. Requests with images are not speculated (the draft layer embeds the prompt's own ids).
"""

from __future__ import annotations

import base64
import contextlib
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class SlotImages:
    spans: list
    cos: torch.Tensor  # [T, rot]: the prompt's own rotary rows
    sin: torch.Tensor
    delta: int  # what every position after the prompt adds to its rotary position (0 or less)


def begin(vision, req: dict, ids: list[int]) -> tuple[list[int], SlotImages | None]:
    """A request's (ids to run, its images' bookkeeping or None). ValueError for images the rank cannot take."""
    from engine.vision import preprocess
    from engine.vision import serve as vserve

    images = req.get("images") or []
    if not images:
        return ids, None
    if vision is None:
        raise ValueError("images are not served here: the model has no vision tower, or the service runs with "
                         "--no-vision")
    try:
        pix = [preprocess.pixels(preprocess.decode(base64.b64decode(s), vserve.DECODE_LIMIT_PIXELS), vision.rules)
               for s in images]
        keys, spans, cos, sin, delta = vision.slot_prompt(ids, pix)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - an image the decoder cannot read is this request's fault alone
        raise ValueError(f"the image could not be read: {type(e).__name__}: {e}") from None
    return keys, SlotImages(spans, cos, sin, delta)


@contextlib.contextmanager
def prefilling(model, vision, img: SlotImages | None):
    """The model's prefill reads this request's rotary rows and image embeddings inside (nothing for None)."""
    if img is None:
        yield
        return
    saved = model.cos, model.sin, model.embed_prompt, vision.spans
    model.cos, model.sin, model.embed_prompt, vision.spans = img.cos, img.sin, vision.embed, img.spans
    try:
        yield
    finally:
        model.cos, model.sin, model.embed_prompt, vision.spans = saved
