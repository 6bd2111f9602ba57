"""The image_input scenario: a chat with an image through the bundled engine's vision tower (engine/vision,
engine/service/images.py). Waived, with the reason, where the service serves no images (a text-only model, or
serve --no-vision), as its keyed /health says (``vision``)."""

from __future__ import annotations

import base64
import struct
import zlib

from v100plan.accept import features  # noqa: F401 - the functional cases it follows register first
from v100plan.accept.cases import Outcome, case
from v100plan.accept.context import Context

IMAGE_TOKENS = 16
NO_VISION = {"absent": "the model has no vision tower (a text-only checkpoint): serve a Qwen3.5 multimodal "
                       "checkpoint (a demo: python -m engine make-demo-model DIR --arch qwen3_5 --vision)",
             "off": "the service runs with --no-vision: serve without it to check image input"}


def png(width: int, height: int) -> bytes:
    """A small RGB gradient as a PNG file, written with the standard library (the control plane has no imaging
    library)."""
    rows = b"".join(b"\x00" + bytes(v for x in range(width)  # filter 0, then R, G, B per pixel
                                    for v in (x * 255 // width, y * 255 // height, (x * y) % 256))
                    for y in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def _applicable(ctx: Context) -> str | None:
    if not ctx.is_engine:
        return f"needs the bundled engine (its v100plan extension); this server is {ctx.server or 'another make'}"
    h = ctx.health()
    vision = h.body.get("vision") if h.ok and isinstance(h.body, dict) else None
    if vision is None:
        return "the service does not say whether it serves images (no vision in its keyed /health): give accept " \
               "the API key"
    return NO_VISION.get(vision)


def _chat(ctx: Context, url: str) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe the picture."}]
    return {"model": ctx.model, "messages": [{"role": "user", "content": content}], "max_tokens": IMAGE_TOKENS,
            "temperature": 0.0, **({"ignore_eos": True} if ctx.ignore_eos else {})}


@case("image_input", "a chat with an image (a data: URI PNG) answers; the same chat again answers the same tokens "
      "and reuses the image's tokens from the prefix cache; a malformed image is a 400 naming it, and the service "
      "answers the image chat the same afterwards", group="functional", timeout_s=300, applicable=_applicable)
def image_input(ctx: Context) -> Outcome:
    o = Outcome()
    url = "data:image/png;base64," + base64.b64encode(png(96, 64)).decode()
    post = lambda body: ctx.client.post("/v1/chat/completions", body)  # noqa: E731
    first = post(_chat(ctx, url))
    if not o.check(first.ok and bool(first.token_ids()), f"the image chat answered {first.status}: "
                                                         f"{first.error_message()}"):
        return o
    again = post(_chat(ctx, url))
    o.check(again.ok and again.token_ids() == first.token_ids(), "the same image chat answered differently")
    usage = (again.body or {}).get("usage") or {} if again.ok else {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    o.check(cached > 0, "the same image chat again reused nothing from the prefix cache")
    bad = post(_chat(ctx, "data:image/png;base64,aGVsbG8="))
    o.check(bad.status == 400 and "image" in bad.error_message().lower(),
            f"a malformed image answered {bad.status}: {bad.error_message()[:120]!r} (expected a 400 naming it)")
    after = post(_chat(ctx, url))
    o.check(after.ok and after.token_ids() == first.token_ids(), "after the malformed image the image chat "
                                                                 "answered differently")
    o.metrics.update(prompt_tokens=usage.get("prompt_tokens"), cached_tokens=cached)
    o.note("http", f"image chat: {usage.get('prompt_tokens')} prompt tokens, {cached} cached on the repeat; "
                   f"malformed image: {bad.status} {bad.error_message()[:120]}", bad.status)
    return o
