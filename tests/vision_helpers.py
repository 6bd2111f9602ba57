"""What the vision tests share: random images, transformers' processor output for a prompt, and transformers'
greedy continuation (the oracle the engine's answers are judged against)."""

from __future__ import annotations

import io

import torch


def image(w: int, h: int, seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def hf_inputs(image_token_id: int, ids: list[int], images: list) -> dict:
    """transformers' Qwen2-VL processor (Pillow backend) with the demo's preprocessor settings, and the ids."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from engine.vision.demo import PREPROCESSOR

    proc = Qwen2VLImageProcessorPil(**{k: v for k, v in PREPROCESSOR.items() if k != "image_processor_type"})
    pv = proc(images=images, return_tensors="pt")
    t = torch.tensor([ids])
    return dict(input_ids=t, pixel_values=pv["pixel_values"], image_grid_thw=pv["image_grid_thw"],
                mm_token_type_ids=(t == image_token_id).int())


def hf_greedy(hf, inputs: dict, n: int) -> list[int]:
    """transformers' greedy continuation of exactly n tokens, end-of-sequence ids included: the whole sequence
    again at every step (its multimodal positions recomputed from the ids each time), no cache."""
    inputs = dict(inputs)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(hf(**inputs, use_cache=False).logits[0, -1].argmax())
            out.append(nxt)
            inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([[nxt]])], 1)
            if "mm_token_type_ids" in inputs:
                inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"],
                                                         torch.zeros(1, 1, dtype=torch.int)], 1)
    return out
