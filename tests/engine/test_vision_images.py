"""engine.service.images: image_url parts -> checked image bytes. Every limit answered with a message naming
it, a decoding bomb refused from its header before any pixel is decoded, URLs fetched from a real local HTTP
server only with --allow-image-urls, with byte and time limits."""

from __future__ import annotations

import base64
import http.server
import struct
import threading
import time
import zlib

import pytest

from engine.service.images import ImageLimits, ImageRefused, check, load, load_all
from tests.vision_helpers import image, png


def uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def bomb_png(w: int, h: int) -> bytes:
    """A PNG whose header declares w x h RGB pixels and whose data is a few bytes of garbage: decoding it would
    fail (or, with real data, take w x h x 3 bytes); refusing it must happen from the header alone."""
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", b"\x78\x9c" + b"\x00" * 16) + _chunk(b"IEND", b""))


def test_data_uris_of_png_jpeg_webp_pass_with_their_size():
    img = image(40, 30, 1)
    for fmt, mime in (("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")):
        import io

        buf = io.BytesIO()
        img.save(buf, format=fmt)
        got = load(uri(buf.getvalue(), mime), ImageLimits(), "p")
        assert (got.format, got.width, got.height) == (fmt, 40, 30)


def test_a_bomb_is_refused_from_its_header_before_decoding():
    limits = ImageLimits(max_pixels=4096 * 4096)
    with pytest.raises(ImageRefused, match=r"12000x12000 = 144000000 pixels.*--max-image-pixels.*not decoded") as e:
        check(bomb_png(12000, 12000), limits, "messages.0.content.1")
    assert e.value.param == "messages.0.content.1"
    # past Pillow's own bomb threshold the header is refused the same way, never decoded
    with pytest.raises(ImageRefused, match="not decoded"):
        check(bomb_png(100000, 100000), limits, "p")


def test_the_pixel_limit_counts_width_times_height():
    data = png(image(64, 64, 2))
    assert check(data, ImageLimits(max_pixels=64 * 64), "p").width == 64
    with pytest.raises(ImageRefused, match="64x64 = 4096 pixels.*at most 4095"):
        check(data, ImageLimits(max_pixels=4095), "p")


def test_too_many_images_are_refused_before_any_is_read():
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * 3}]
    with pytest.raises(ImageRefused, match="3 images.*at most 2 per request \\(--max-images\\)") as e:
        load_all(msgs, ImageLimits(max_images=2))
    assert e.value.param == "messages.0.content.2"


def test_malformed_and_unsupported_images_are_refused():
    limits = ImageLimits()
    cases = [("data:image/png;base64,@@@@", "base64 is malformed"),
             (uri(b"not an image at all"), "not a PNG, JPEG or WebP"),
             (uri(png(image(8, 8, 1)), "image/gif"), "image/gif"),
             (uri(png(image(30, 30, 1))[:60]), "damaged"),
             ("ftp://example.org/x.png", "data: URI or an http"),
             ("", "empty")]
    import io

    gif = io.BytesIO()
    image(8, 8, 1).save(gif, format="GIF")
    cases.append((uri(gif.getvalue()), "format GIF"))
    for url, msg in cases:
        with pytest.raises(ImageRefused, match=msg):
            load(url, limits, "p")


def test_the_byte_limit_holds_for_inline_images():
    data = png(image(64, 64, 3))
    with pytest.raises(ImageRefused, match="bytes"):
        load(uri(data), ImageLimits(max_bytes=len(data) - 1), "p")
    with pytest.raises(ImageRefused, match="bytes"):
        load(uri(data), ImageLimits(max_bytes=len(data) // 2), "p")  # refused from the string's length


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        if self.path == "/slow.png":
            time.sleep(2)
        if self.path == "/missing.png":
            self.send_error(404)
            return
        body = self.server.files.get(self.path.split("?")[0], b"")
        try:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (the timeout case)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def web():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.files = {"/ok.png": png(image(48, 32, 4)), "/slow.png": png(image(8, 8, 5)), "/big.png": png(image(200, 200, 6))}
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_urls_are_refused_without_allow_image_urls(web):
    with pytest.raises(ImageRefused, match="--allow-image-urls"):
        load(web + "/ok.png", ImageLimits(), "p")


def test_urls_are_fetched_with_allow_image_urls_and_their_limits(web):
    ok = load(web + "/ok.png", ImageLimits(allow_urls=True), "p")
    assert (ok.width, ok.height) == (48, 32)
    with pytest.raises(ImageRefused, match="took over 0.5 s"):
        load(web + "/slow.png", ImageLimits(allow_urls=True, fetch_timeout_s=0.5), "p")
    with pytest.raises(ImageRefused, match="over 1000 bytes"):
        load(web + "/big.png", ImageLimits(allow_urls=True, max_bytes=1000), "p")
    with pytest.raises(ImageRefused, match="HTTP 404"):
        load(web + "/missing.png", ImageLimits(allow_urls=True), "p")
