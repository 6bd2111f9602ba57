"""Images through the HTTP service (`python -m engine serve --tp 2` on the vision demo, real rank processes on
127.0.0.1) with the official openai client: answers equal to transformers' Qwen3_5ForConditionalGeneration on
the same weights and processor output, two images, a follow-up turn reusing the image from the prefix cache with
the cold answer, every limit and a malformed or bomb image answered 400 with the service undisturbed."""

from __future__ import annotations

import base64
import functools
import os
from pathlib import Path

import openai
import pytest

from tests.test_service_support import ServiceProcess, reference_until_eos, short_dir
from tests.vision_helpers import hf_greedy, hf_inputs, image, png

pytestmark = pytest.mark.slow

KEY = "test-key-v1s10n"
N = 12
PAD = "<|vision_start|><|image_pad|><|vision_end|>"


@functools.lru_cache(maxsize=1)
def vision_demo() -> str:
    from engine.vision import demo

    d = os.path.join(short_dir("vdemo"), "m")
    demo.make(d)
    return d


@functools.lru_cache(maxsize=1)
def hf_model():
    import transformers

    return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(vision_demo()).eval()


def data_uri(img) -> str:
    return "data:image/png;base64," + base64.b64encode(png(img)).decode()


def oracle(turns: list[tuple[str, str]], images: list) -> list[int]:
    """transformers' greedy answer (until the first EOS) to a chat whose texts hold PAD where each image goes."""
    from engine.core.tokenizer import Tokenizer
    from engine.vision import config as vconfig
    from engine.vision import serve as vserve

    d = vision_demo()
    tok = Tokenizer(d)
    vcfg = vconfig.load(d)
    ids = tok.encode(tok.render_chat([{"role": r, "content": t} for r, t in turns]))
    ids = vserve.expand_prompt(ids, [png(i) for i in images], vcfg, vconfig.image_rules(d, vcfg))
    return reference_until_eos(hf_greedy(hf_model(), hf_inputs(vcfg.image_token_id, ids, images), N))


@pytest.fixture(scope="module")
def svc():
    s = ServiceProcess("--max-context", "1024", "--max-images", "2", "--max-image-pixels", str(300 * 300),
                       model=vision_demo(), api_key=KEY, stall_timeout_s=60, allreduce_timeout_s=30)
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(svc):
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def ask(client, content, history=()):
    msgs = [*history, {"role": "user", "content": content}]
    return client.chat.completions.create(model="v100plan-demo-vision", messages=msgs, max_tokens=N, temperature=0)


def test_health_names_vision_on(svc):
    body = svc.client.get("/health").json()
    assert body["vision"] == "on" and body["max_images"] == 2 and body["allow_image_urls"] is False
    logs = [p.read_text() for p in Path(svc.state_dir, "logs").glob("rank*.g*.log")]
    assert len(logs) == 2 and all("vision on" in text for text in logs)  # each rank loaded its own tower


def test_one_and_two_images_answer_as_transformers(client):
    a, b = image(100, 70, 21), image(160, 90, 22)
    r = ask(client, [{"type": "text", "text": "see "}, {"type": "image_url", "image_url": {"url": data_uri(a)}},
                     {"type": "text", "text": " and say"}])
    assert r.model_extra["v100plan"]["token_ids"] == oracle([("user", f"see {PAD} and say")], [a])
    r2 = ask(client, [{"type": "image_url", "image_url": {"url": data_uri(a)}}, {"type": "text", "text": "vs"},
                      {"type": "image_url", "image_url": {"url": data_uri(b)}}])
    assert r2.model_extra["v100plan"]["token_ids"] == oracle([("user", f"{PAD}vs{PAD}")], [a, b])
    from engine.core.tokenizer import Tokenizer

    tok = Tokenizer(vision_demo())
    text_only = len(tok.encode(tok.render_chat([{"role": "user", "content": f"{PAD}vs{PAD}"}])))
    assert r2.usage.prompt_tokens == text_only - 2 + 6 + 15  # each pad token becomes 2 x 3 and 3 x 5 image tokens


def test_a_follow_up_turn_reuses_the_image_and_answers_as_cold(client):
    img = image(120, 120, 23)
    first = [{"type": "image_url", "image_url": {"url": data_uri(img)}}, {"type": "text", "text": "what"}]
    r1 = ask(client, first)
    history = [{"role": "user", "content": first}, {"role": "assistant", "content": r1.choices[0].message.content}]
    r2 = ask(client, "and now?", history)
    assert r2.usage.prompt_tokens_details.cached_tokens > 16  # past the image's 4 x 4 tokens
    turns = [("user", f"{PAD}what"), ("assistant", r1.choices[0].message.content), ("user", "and now?")]
    assert r2.model_extra["v100plan"]["token_ids"] == oracle(turns, [img])


def test_every_limit_and_bad_image_is_a_400_naming_it_and_nothing_else_is_disturbed(svc, client):
    from tests.engine.test_vision_images import bomb_png

    ok = data_uri(image(64, 64, 24))
    bomb = "data:image/png;base64," + base64.b64encode(bomb_png(20000, 20000)).decode()
    cases = [
        ([{"type": "image_url", "image_url": {"url": ok}}] * 3, "--max-images"),
        ([{"type": "image_url", "image_url": {"url": data_uri(image(400, 300, 1))}}], "--max-image-pixels"),
        ([{"type": "image_url", "image_url": {"url": bomb}}], "not decoded"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}], "base64"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}], "PNG, JPEG or WebP"),
        ([{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}], "--allow-image-urls"),
        ([{"type": "text", "text": f"spelled {PAD}"}], "image-pad token"),
    ]
    for content, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, content)
        assert e.value.status_code == 400 and words in e.value.message, e.value.message
    r = ask(client, [{"type": "image_url", "image_url": {"url": ok}}, {"type": "text", "text": "fine"}])
    assert r.model_extra["v100plan"]["token_ids"] == oracle([("user", f"{PAD}fine")], [image(64, 64, 24)])
    assert svc.client.get("/health").json()["status"] == "ok"


def test_the_acceptance_scenario_passes_against_the_vision_service(svc):
    from v100plan.accept import images as accept_images
    from v100plan.accept.context import AcceptOptions, Context, Target

    ctx = Context(Target(endpoint=svc.url, api_key=KEY), AcceptOptions())
    try:
        ctx.discover()
        assert accept_images._applicable(ctx) is None
        o = accept_images.image_input(ctx)
        assert o.status == "passed", o.reason
        assert o.metrics["cached_tokens"] > 0
    finally:
        ctx.close()


def test_the_acceptance_scenario_is_waived_with_the_reason_without_vision(svc):
    from v100plan.accept import images as accept_images
    from v100plan.accept.context import AcceptOptions, Context, Target
    from v100plan.accept.http import Answer

    ctx = Context(Target(endpoint=svc.url, api_key=KEY), AcceptOptions())
    ctx.is_engine = True
    for said, words in (("absent", "text-only checkpoint"), ("off", "--no-vision")):
        ctx.health = lambda s=said: Answer(200, {"status": "ok", "vision": s})
        assert words in accept_images._applicable(ctx)
    ctx.is_engine = False
    assert "bundled engine" in accept_images._applicable(ctx)
    ctx.close()


def test_no_vision_leaves_the_tower_unloaded_and_refuses_images_naming_the_flag():
    s = ServiceProcess("--max-context", "512", "--no-vision", model=vision_demo(), api_key=KEY,
                       stall_timeout_s=60, allreduce_timeout_s=30)
    try:
        s.wait_healthy()
        h = s.client.get("/health").json()
        assert h["vision"] == "off"
        logs = [p.read_text() for p in Path(s.state_dir, "logs").glob("rank*.g*.log")]
        assert len(logs) == 2 and all("vision off" in text for text in logs)  # both ranks left the tower unloaded
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, [{"type": "image_url", "image_url": {"url": data_uri(image(64, 64, 1))}}])
        assert "--no-vision" in e.value.message
        assert ask(client, "just text").choices[0].finish_reason in ("length", "stop")
    finally:
        s.stop()
