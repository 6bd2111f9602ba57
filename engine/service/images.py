"""Images in a chat request, on the proxy: an ``image_url`` part's URL -> the image file's bytes, checked.

  - ``data:image/png;base64,...`` (PNG, JPEG, WebP): decoded from base64 here;
  - ``http(s)://...``: fetched only when the service runs with ``--allow-image-urls`` (the proxy then reaches
    whatever URL a client names: turn it on only where that is wanted), with a byte limit and a time limit;
  - every request at most ``--max-images`` images, every image at most ``--max-image-pixels`` pixels;
  - decoding-bomb protection: the width and height are read from the file's header (Pillow opens lazily: no
    pixel is decoded) and a picture over the pixel limit is refused before it is decoded; then the whole file
    is decoded once here, so a broken one is answered 400 by the proxy, never a failure on the ranks.

Each violation raises ImageRefused: a 400 whose message names the limit (and the flag that sets it) and whose
``param`` names the part (``messages.I.content.J``). The bytes that pass go to both ranks unchanged
(engine.vision.serve), which decode them the same way.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import re
import urllib.error
import urllib.request
import warnings

FORMATS = ("PNG", "JPEG", "WEBP")
MIME = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
_DATA = re.compile(r"^data:(?P<mime>[\w/+.-]+)?(?P<params>(;[\w=.+-]+)*);base64,(?P<data>.*)$", re.S)


class ImageRefused(Exception):
    """An image the service does not take: HTTP 400 with this message, for the part ``param``."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    allow_urls: bool = False  # --allow-image-urls
    max_images: int = 4  # --max-images: per request
    max_pixels: int = 16_777_216  # --max-image-pixels: width x height of one image (4096 x 4096)
    max_bytes: int = 20 << 20  # an image file's size (base64-decoded, or fetched)
    fetch_timeout_s: float = 10.0  # a URL's whole fetch


@dataclasses.dataclass(frozen=True)
class CheckedImage:
    data: bytes
    format: str
    width: int
    height: int


def count_check(n: int, limits: ImageLimits, param: str) -> None:
    if n > limits.max_images:
        raise ImageRefused(f"the request holds {n} images; this service takes at most {limits.max_images} per "
                           f"request (--max-images)", param)


def load(url: str, limits: ImageLimits, param: str) -> CheckedImage:
    """An image_url part's URL -> its checked bytes (ImageRefused on any violation)."""
    if not isinstance(url, str) or not url:
        raise ImageRefused("image_url.url is empty: give a data: URI (base64 PNG, JPEG or WebP) or an http(s) URL",
                           param)
    if url.startswith("data:"):
        data = _from_data_uri(url, limits, param)
    elif url.startswith(("http://", "https://")):
        if not limits.allow_urls:
            raise ImageRefused("image URLs are not fetched by this service (it runs without --allow-image-urls): "
                               "send the image inline as a data: URI (data:image/png;base64,...)", param)
        data = _fetch(url, limits, param)
    else:
        raise ImageRefused(f"image_url.url must be a data: URI or an http(s) URL, not {url[:24]!r}...", param)
    return check(data, limits, param)


def check(data: bytes, limits: ImageLimits, param: str) -> CheckedImage:
    """The header's format and size checked before decoding, then one full decode."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageRefused(f"the image is {len(data)} bytes; this service takes at most {limits.max_bytes}", param)
    try:
        with warnings.catch_warnings():  # Pillow's own bomb warning: the limit below decides, with its message
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError:
        raise ImageRefused(f"the image's header declares more pixels than this service takes "
                           f"({limits.max_pixels}, --max-image-pixels); it was not decoded", param) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise ImageRefused("the image is not a PNG, JPEG or WebP file this service can read", param) from None
    if img.format not in FORMATS:
        raise ImageRefused(f"image format {img.format}: this service takes {', '.join(FORMATS)}", param)
    w, h = img.size
    if w * h > limits.max_pixels:
        raise ImageRefused(f"the image is {w}x{h} = {w * h} pixels; this service takes at most {limits.max_pixels} "
                           "per image (--max-image-pixels); it was not decoded", param)
    try:
        img.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ImageRefused(f"the {img.format} image is damaged and cannot be decoded ({e})", param) from None
    return CheckedImage(data, img.format, w, h)


def _from_data_uri(url: str, limits: ImageLimits, param: str) -> bytes:
    m = _DATA.match(url)
    if m is None:
        raise ImageRefused("a data: URI image must be base64: data:image/png;base64,... (or image/jpeg, image/webp)",
                           param)
    mime = (m.group("mime") or "").lower()
    if mime not in MIME:
        raise ImageRefused(f"data: URI of type {mime or 'none'!r}: this service takes {', '.join(sorted(MIME))}",
                           param)
    text = m.group("data")
    if len(text) > (limits.max_bytes + 2) // 3 * 4 + 4:  # refuse before decoding a too-long string
        raise ImageRefused(f"the image is over {limits.max_bytes} bytes; this service takes at most that", param)
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused("the data: URI's base64 is malformed", param) from None


def _fetch(url: str, limits: ImageLimits, param: str) -> bytes:
    """GET with a timeout, reading at most max_bytes + 1 (the body is not trusted to state its length)."""
    req = urllib.request.Request(url, headers={"User-Agent": "v100plan-engine", "Accept": "image/*"})
    try:
        with urllib.request.urlopen(req, timeout=limits.fetch_timeout_s) as resp:  # noqa: S310 - only http(s)
            body = resp.read(limits.max_bytes + 1)
    except urllib.error.HTTPError as e:
        raise ImageRefused(f"fetching the image URL answered HTTP {e.code}", param) from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        why = getattr(e, "reason", e)
        if isinstance(why, TimeoutError) or "timed out" in str(why):
            raise ImageRefused(f"fetching the image URL took over {limits.fetch_timeout_s:g} s", param) from None
        raise ImageRefused(f"fetching the image URL failed: {why}", param) from None
    if len(body) > limits.max_bytes:
        raise ImageRefused(f"the image at the URL is over {limits.max_bytes} bytes; this service takes at most that",
                           param)
    return body


def image_parts(messages: list) -> list[tuple[str, str]]:
    """(url, param) of every image_url part in the messages (dicts or pydantic models), in prompt order."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            p = part if isinstance(part, dict) else (part.model_dump() if hasattr(part, "model_dump") else {})
            if p.get("type") == "image_url":
                iu = p.get("image_url")
                url = iu.get("url") if isinstance(iu, dict) else iu
                out.append((url, f"messages.{i}.content.{j}"))
    return out


def load_all(messages: list, limits: ImageLimits) -> list[CheckedImage]:
    """Every image of a chat request, checked (count first: no image is fetched or decoded past the limit)."""
    parts = image_parts(messages)
    if parts:
        count_check(len(parts), limits, parts[limits.max_images][1] if len(parts) > limits.max_images else "messages")
    return [load(url, limits, param) for url, param in parts]


class ProxyImages:
    """The proxy's side of images for one service: whether they are served (a tower in the checkpoint and no
    --no-vision), the limits, and the chat prompt's image tokens (one image-pad token per image_url part, then
    each image's token count, from its header's size by the processor's rules: engine.vision.preprocess)."""

    def __init__(self, model_dir: str, limits: ImageLimits, no_vision: bool, tokenizer=None):
        from engine.vision import config as vconfig

        self.limits = limits
        self.vcfg = vconfig.load(model_dir)
        self.rules = vconfig.image_rules(model_dir, self.vcfg) if self.vcfg is not None else None
        self.on = self.vcfg is not None and not no_vision
        self.off_reason = None if self.on else (
            "this service runs with --no-vision" if self.vcfg is not None
            else "the model has no vision tower (a text-only checkpoint)")
        self.placeholder = ""
        if self.on and tokenizer is not None:  # what the family's template writes for an image part
            v = self.vcfg
            self.placeholder = tokenizer.decode([v.vision_start_token_id, v.image_token_id, v.vision_end_token_id],
                                                skip_special=False)

    @classmethod
    def from_serve(cls, cfg, text) -> ProxyImages:
        return cls(cfg.model_dir, ImageLimits(allow_urls=cfg.allow_image_urls, max_images=cfg.max_images,
                                              max_pixels=cfg.max_image_pixels), cfg.no_vision, text.tokenizer)

    def health(self) -> dict:
        out: dict = {"vision": "on" if self.on else ("off" if self.vcfg is not None else "absent")}
        if self.on:
            out.update(allow_image_urls=self.limits.allow_urls, max_images=self.limits.max_images,
                       max_image_pixels=self.limits.max_pixels)
        return out

    def serves(self, media_types: list[str]) -> bool:
        """Whether a message's non-text parts are all ones this service takes (image_url, with vision on)."""
        return self.on and all(t == "image_url" for t in media_types)

    async def load(self, messages: list) -> list[CheckedImage]:
        import asyncio

        parts = image_parts(messages)
        if parts and self.vcfg is not None and not self.on:
            raise ImageRefused(f"image_url input is not served: {self.off_reason}; send text parts", parts[0][1])
        if not self.on or not parts:
            return []  # (a text-only model's image parts are refused with the other media types, by the app)
        return await asyncio.to_thread(load_all, messages, self.limits)  # a URL fetch must not block the loop

    def text(self, message) -> str:
        """A message's text with the image placeholder where each image_url part is."""
        content = message.content
        if isinstance(content, str):
            return content
        parts = [p.model_dump() if hasattr(p, "model_dump") else p for p in content]
        return "".join(p.get("text", "") if p.get("type") == "text" else
                       self.placeholder if p.get("type") == "image_url" and self.on else "" for p in parts)

    def expand(self, ids: list[int], images: list[CheckedImage]) -> list[int]:
        """The prompt's image-pad tokens -> each image's count of them; a pad without its image is a 400."""
        if not self.on:
            return ids
        from engine.vision.preprocess import token_count

        pad = self.vcfg.image_token_id
        n = ids.count(pad)
        if n != len(images):
            raise ImageRefused(f"the prompt holds {n} image-pad token(s) for {len(images)} image part(s): the text "
                               f"must not spell the image tokens itself", "messages")
        out: list[int] = []
        it = iter(images)
        for t in ids:
            if t == pad:
                img = next(it)
                out += [pad] * token_count(img.height, img.width, self.rules)
            else:
                out.append(t)
        return out


def wire(pics: list[CheckedImage]) -> list[str]:
    """The images as the generate message carries them to the ranks (engine.vision.serve)."""
    from engine.vision.serve import wire as _wire

    return _wire([p.data for p in pics])
