"""Images as requests give them: data: URLs, bare base64 (Ollama's `images`), file paths (the command
line) and, natively, http(s) URLs fetched within size and time limits. Each becomes an `ImageInput`:
the decoded RGB picture (Pillow) and the SHA-256 of its bytes (what identifies it, e.g. in logs).

Decoding errors are typed (`InvalidImageError`, 400) and name the request part that carried the
image. Pillow is imported on first use: text-only requests never load it.

A picture already decoded travels as its RGBA pixels, `data:image/x-rgba;width=W;height=H;base64,...`
(what the browser page sends: the page has no Pillow, so its JavaScript decodes the picture):
natively it becomes a Pillow image as any other, without Pillow a vision/pure.py RGBImage.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidRequestError

MAX_IMAGE_BYTES = 20 * 1024 * 1024      # an image's encoded bytes, as the server's body limit allows
MAX_IMAGE_PIXELS = 40_000_000           # decoded size: a decompression bomb is refused before decoding
FETCH_TIMEOUT_S = 15.0
RAW_RGBA = "image/x-rgba"                # a data: URL of decoded pixels (width and height as parameters)
_DATA_URL = re.compile(r"^data:(?P<mime>[\w/+.-]*)(?P<params>(;[\w=.+-]+)*?)(?P<b64>;base64)?,(?P<data>.*)$", re.S)


class InvalidImageError(InvalidRequestError):
    """An image part that is not a decodable image (or is too large, or could not be fetched)."""

    def __init__(self, where: str, why: str):
        super().__init__(f"{where}: {why}", param=where)


@dataclass(frozen=True)
class ImageInput:
    """One decoded image of a request: `image` (PIL RGB), `sha256` of the encoded bytes."""

    image: object = field(repr=False, compare=False)
    sha256: str
    width: int
    height: int

    def __repr__(self) -> str:           # message contents are measured with str(): keep it short
        return f"<image {self.width}x{self.height} {self.sha256[:12]}>"


def decode_bytes(raw: bytes, where: str) -> ImageInput:
    """Decode encoded image bytes (PNG, JPEG, WebP, GIF's first frame, ...) into RGB. A picture with
    transparency is composited on white first, as transformers' convert_rgb does."""
    if len(raw) > MAX_IMAGE_BYTES:
        raise InvalidImageError(where, f"the image has {len(raw)} bytes, more than {MAX_IMAGE_BYTES}")
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise InvalidImageError(where, f"encoded images are not decoded here (no Pillow, as in the browser "
                                       f"page): send the picture's pixels as a data:{RAW_RGBA};width=W;height=H;"
                                       f"base64 URL") from None
    try:
        img = Image.open(io.BytesIO(raw))
        if img.width * img.height > MAX_IMAGE_PIXELS:
            raise InvalidImageError(where, f"the image is {img.width}x{img.height}, more than "
                                           f"{MAX_IMAGE_PIXELS} pixels")
        img.load()
    except InvalidImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise InvalidImageError(where, f"not a decodable image ({type(e).__name__}: {e})") from e
    return ImageInput(to_rgb(img), hashlib.sha256(raw).hexdigest(), img.width, img.height)


def to_rgb(img):
    """RGB as transformers' convert_rgb: other modes through RGBA, alpha composited on white."""
    from PIL import Image
    if img.mode == "RGB":
        return img
    rgba = img.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def decode_rgba(raw: bytes, width: int, height: int, where: str) -> ImageInput:
    """A picture's RGBA pixels (rows of width x (r, g, b, a) bytes), alpha composited on white."""
    if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
        raise InvalidImageError(where, f"an RGBA picture of {width}x{height} pixels (1 to {MAX_IMAGE_PIXELS})")
    if len(raw) != 4 * width * height:
        raise InvalidImageError(where, f"{len(raw)} bytes for an RGBA picture of {width}x{height} "
                                       f"({4 * width * height} expected)")
    digest = hashlib.sha256(b"%d,%d," % (width, height) + raw).hexdigest()
    try:
        from PIL import Image
    except ImportError:                  # the page: the pure-Python picture
        from .pure import from_rgba
        return ImageInput(from_rgba(raw, width, height), digest, width, height)
    return ImageInput(to_rgb(Image.frombytes("RGBA", (width, height), raw)), digest, width, height)


def _raw_rgba(m: re.Match, where: str) -> ImageInput:
    params = dict(p.split("=", 1) for p in m.group("params").split(";") if "=" in p)
    try:
        width, height = int(params["width"]), int(params["height"])
    except (KeyError, ValueError):
        raise InvalidImageError(where, f"a data:{RAW_RGBA} URL needs ;width=W;height=H parameters") from None
    if not m.group("b64"):
        raise InvalidImageError(where, f"a data:{RAW_RGBA} URL must be base64")
    try:
        raw = base64.b64decode("".join(m.group("data").split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidImageError(where, f"not valid base64 ({e})") from e
    return decode_rgba(raw, width, height, where)


def decode_base64(text: str, where: str) -> ImageInput:
    """Bare base64 (Ollama's `images` entries), whitespace allowed."""
    try:
        raw = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidImageError(where, f"not valid base64 ({e})") from e
    return decode_bytes(raw, where)


def decode_data_url(url: str, where: str) -> ImageInput:
    m = _DATA_URL.match(url)
    if m is None:
        raise InvalidImageError(where, "a malformed data: URL (expected data:image/<type>;base64,<data>)")
    if m.group("mime") == RAW_RGBA:
        return _raw_rgba(m, where)
    if m.group("mime") and not m.group("mime").startswith("image/"):
        raise InvalidImageError(where, f"a data: URL of {m.group('mime')!r}, not an image")
    if not m.group("b64"):
        from urllib.parse import unquote_to_bytes
        return decode_bytes(unquote_to_bytes(m.group("data")), where)
    return decode_base64(m.group("data"), where)


def fetch(url: str, where: str, *, max_bytes: int | None = None, timeout_s: float | None = None) -> bytes:
    """GET an http(s) URL, refusing bodies over `max_bytes` and answers slower than `timeout_s`.
    Blocking: call it off the event loop."""
    max_bytes = MAX_IMAGE_BYTES if max_bytes is None else max_bytes
    timeout_s = FETCH_TIMEOUT_S if timeout_s is None else timeout_s
    import time
    import urllib.error
    import urllib.request
    deadline = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "webgpu_engine"}),
                                    timeout=timeout_s) as r:
            declared = r.headers.get("Content-Length")
            if declared and declared.isdigit() and int(declared) > max_bytes:
                raise InvalidImageError(where, f"{url} has {declared} bytes, more than {max_bytes}")
            parts, size = [], 0
            while size <= max_bytes:      # the whole answer within timeout_s, not each read
                if time.monotonic() > deadline:
                    raise InvalidImageError(where, f"{url} took more than {timeout_s:g} s")
                chunk = r.read1(min(1 << 16, max_bytes + 1 - size))   # what has come, not 64 KB
                if not chunk:
                    break
                parts.append(chunk)
                size += len(chunk)
            raw = b"".join(parts)
    except InvalidImageError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise InvalidImageError(where, f"could not fetch {url} ({e})") from e
    if len(raw) > max_bytes:
        raise InvalidImageError(where, f"{url} has more than {max_bytes} bytes")
    return raw


def load_image(source: str, where: str, *, allow_files: bool = False, allow_fetch: bool = True) -> ImageInput:
    """An image from a data: URL, an http(s) URL (when `allow_fetch`; blocking), or, when
    `allow_files` (the command line, the Python API), a file path."""
    if not isinstance(source, str) or not source:
        raise InvalidImageError(where, "an image needs a URL (data: or http(s)) as a string")
    if source.startswith("data:"):
        return decode_data_url(source, where)
    if source.startswith(("http://", "https://")):
        if not allow_fetch:
            raise InvalidImageError(where, "http(s) image URLs are not fetched here: send a data: URL")
        return decode_bytes(fetch(source, where), where)
    if allow_files:
        p = Path(source[7:] if source.startswith("file://") else source)
        if p.is_file():
            if p.stat().st_size > MAX_IMAGE_BYTES:
                raise InvalidImageError(where, f"{p} has more than {MAX_IMAGE_BYTES} bytes")
            return decode_bytes(p.read_bytes(), where)
        raise InvalidImageError(where, f"no image file at {source}")
    raise InvalidImageError(where, "an image URL must be a data: URL or an http(s) URL")


def image_data_url(path) -> str:
    """A data: URL of an image file (the command line's --image, tests)."""
    p = Path(path)
    if not p.is_file():
        raise InvalidImageError(str(path), "no image file there")
    mime = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
            ".gif": "image/gif"}.get(p.suffix.lower(), "application/octet-stream")
    return f"data:{mime};base64,{base64.b64encode(p.read_bytes()).decode('ascii')}"
