"""A prompt with images through the engine (engine.vision: tower, multimodal rotary, the splice of image
embeddings) judged against transformers' Qwen3_5ForConditionalGeneration on the demo's weights
(make-demo-model --arch qwen3_5 --vision) and the same processor output: logits at every prompt position, and
the greedy answer, with one and two images, chunk boundaries inside an image, and a follow-up turn reusing the
prefix cache."""

from __future__ import annotations

import pytest
import torch

from engine.core import config as ecfg
from engine.core import runner, weights
from engine.core.model import Model
from engine.core.sampling import Sampler
from engine.core.tokenizer import Tokenizer
from engine.vision import prompt as vprompt
from engine.vision.load import load_vision
from engine.vision.preprocess import pixels
from tests import vision_helpers
from tests.vision_helpers import hf_greedy, image


@pytest.fixture(scope="module")
def vdemo(tmp_path_factory, one_thread):
    import transformers

    from engine.vision import demo

    d = tmp_path_factory.mktemp("vision-demo")
    demo.make(d)
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(d).eval()
    m = Model(ecfg.load(d))
    weights.load_into(m, d)
    m.setup_cache(1024)
    vis = load_vision(m, d)
    return hf, m, vis, Tokenizer(d), d


def chat(tok, vis, parts_per_turn: list[list], images: list) -> list[int]:
    """The chat template's prompt with the images' tokens expanded."""
    msgs = [{"role": "user", "content": parts} for parts in parts_per_turn]
    ids = tok.encode(tok.render_chat(msgs))
    return vprompt.expand(ids, [pixels(i, vis.rules) for i in images], vis.cfg)


def hf_inputs(vis, ids: list[int], images: list) -> dict:
    return vision_helpers.hf_inputs(vis.cfg.image_token_id, ids, images)


def engine_run(m, vis, ids, images, n, chunk=5):
    keys = vis.begin(ids, [pixels(i, vis.rules) for i in images])
    try:
        info: dict = {}
        out, _ = runner.run(m, keys, n, Sampler(), set(), chunk, info=info)
        return out, info
    finally:
        vis.end()


def test_logits_at_every_position_equal_transformers(vdemo):
    hf, m, vis, tok, _ = vdemo
    imgs = [image(100, 70, 1)]
    ids = chat(tok, vis, [[{"type": "text", "text": "what is "}, {"type": "image"}, {"type": "text", "text": "?"}]], imgs)
    n_img = ids.count(vis.cfg.image_token_id)
    assert n_img == 6  # 100 x 70 -> 96 x 64 pixels -> 6 x 4 patches -> 3 x 2 tokens
    with torch.no_grad():
        ref = hf(**hf_inputs(vis, ids, imgs)).logits[0]
    m.prefix = None
    keys = vis.begin(ids, [pixels(i, vis.rules) for i in imgs])
    try:
        bounds = [0, 9, 14, len(ids)]  # a chunk boundary inside the image's tokens
        assert any(ids[b] == vis.cfg.image_token_id and ids[b - 1] == vis.cfg.image_token_id for b in bounds[1:-1])
        got = torch.cat([m.forward(torch.tensor([keys[a:b]]), a, all_logits=True) for a, b in zip(bounds, bounds[1:])])
    finally:
        vis.end()
    err = (got - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), f"max |diff| {err} of {ref.abs().max().item()}"


@pytest.mark.parametrize("sizes", [[(64, 64)], [(100, 70), (200, 130)]])
def test_greedy_answer_equals_transformers(vdemo, sizes):
    hf, m, vis, tok, _ = vdemo
    imgs = [image(w, h, w + h) for w, h in sizes]
    parts = [{"type": "text", "text": "look"}]
    for _ in imgs:
        parts += [{"type": "image"}, {"type": "text", "text": " and"}]
    ids = chat(tok, vis, [parts], imgs)
    ref = hf_greedy(hf, hf_inputs(vis, ids, imgs), 24)
    m.prefix = None
    out, _ = engine_run(m, vis, ids, imgs, 24)
    assert out == ref


def test_a_text_prompt_after_an_image_prompt_runs_on_plain_rotary(vdemo):
    hf, m, vis, tok, _ = vdemo
    m.prefix = None
    engine_run(m, vis, chat(tok, vis, [[{"type": "image"}]], [image(64, 64, 5)]), [image(64, 64, 5)], 4)
    ids = tok.encode(tok.render_chat([{"role": "user", "content": "no picture here"}]))
    out, _ = engine_run(m, vis, ids, [], 16)
    assert out == hf_greedy(hf, {"input_ids": torch.tensor([ids])}, 16)


def test_a_follow_up_reuses_the_image_from_the_prefix_cache_with_the_cold_answer(vdemo):
    hf, m, vis, tok, _ = vdemo
    img = image(120, 90, 9)
    first = chat(tok, vis, [[{"type": "image"}, {"type": "text", "text": "describe"}]], [img])
    runner.prepare(m)  # a prefix cache, as the ranks hold one
    vis.forget()
    out1, _ = engine_run(m, vis, first, [img], 8)
    runs = vis.encoder_runs
    follow = first + out1 + tok.encode("<|end|>\n<|user|>and again<|end|>\n<|assistant|>")[1:]
    warm, info = engine_run(m, vis, follow, [img], 12)
    assert info["cached_tokens"] > first.index(vis.cfg.image_token_id) + first.count(vis.cfg.image_token_id)
    assert vis.encoder_runs == runs  # the image's tokens came from the cache: the tower did not run again
    m.prefix.forget()
    vis.forget()
    cold, info = engine_run(m, vis, follow, [img], 12)
    assert info["cached_tokens"] == 0 and vis.encoder_runs == runs + 1
    assert warm == cold == hf_greedy(hf, hf_inputs(vis, follow, [img]), 12)
    m.prefix = None


def test_another_image_at_the_same_place_is_not_reused(vdemo):
    _, m, vis, tok, _ = vdemo
    a, b = image(64, 64, 1), image(64, 64, 2)
    runner.prepare(m)
    ids = chat(tok, vis, [[{"type": "image"}, {"type": "text", "text": "x"}]], [a])
    engine_run(m, vis, ids, [a], 6)
    warm, info = engine_run(m, vis, ids, [b], 6)
    # at most up to the image (the hybrid's linear-attention states resume only where a snapshot was kept)
    assert info["cached_tokens"] <= ids.index(vis.cfg.image_token_id)
    m.prefix.forget()
    cold, _ = engine_run(m, vis, ids, [b], 6)
    assert warm == cold
    m.prefix = None


def test_images_and_image_tokens_that_do_not_match_are_refused(vdemo):
    _, m, vis, tok, _ = vdemo
    ids = chat(tok, vis, [[{"type": "image"}]], [image(64, 64, 1)])
    with pytest.raises(vprompt.ImagePromptError, match="run"):
        vis.begin(ids, [])
    with pytest.raises(vprompt.ImagePromptError, match="takes 16 tokens"):
        vis.begin(ids, [pixels(image(128, 128, 1), vis.rules)])


def test_an_image_split_over_prefill_chunks_is_encoded_once_even_without_an_encoder_cache(vdemo):
    _, m, vis, tok, _ = vdemo
    m.prefix = None
    keep, vis.cache_images = vis.cache_images, 0
    try:
        vis.forget()
        runs = vis.encoder_runs
        img = image(200, 130, 4)
        engine_run(m, vis, chat(tok, vis, [[{"type": "image"}]], [img]), [img], 2, chunk=3)
        assert vis.encoder_runs == runs + 1 and not vis.cache
    finally:
        vis.cache_images = keep


def test_the_lockstep_hash_covers_the_towers_output(vdemo):
    """Two ranks whose towers give other bits for the same image fold different hashes into their prefill record
    (engine.vision.serve.lockstep_hash); the same tower gives the same hash, and a request without an encode 0."""
    from engine.vision import serve as vserve

    _, m, vis, tok, _ = vdemo
    m.prefix = None
    img = image(64, 64, 31)
    ids = chat(tok, vis, [[{"type": "image"}]], [img])
    hashes = []
    for bump in (0.0, 0.0, 1e-3):
        vis.forget()
        w = vis.tower.w["merger.linear_fc2.bias"]
        w += bump
        try:
            keys = vis.begin(ids, [pixels(img, vis.rules)])
            m.forward(torch.tensor([keys]), 0)
            hashes.append(vserve.lockstep_hash(vis))
        finally:
            w -= bump
            vis.end()
    assert hashes[0] == hashes[1] != 0 and hashes[2] != hashes[0]
    assert vserve.lockstep_hash(vis) == 0 and hashes[0] < 1 << 63
