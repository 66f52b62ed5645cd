"""Reading the images a request names: data: URLs, local files, http(s) URLs (opt-in).

Every failure is a ``MediaError`` naming the request field (``messages[0].content[1].image_url``,
``image_data[0]``) and the reason; the HTTP layer answers it with a 400.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

#: Seconds an http(s) media fetch may take (--allow-remote-media).
REMOTE_TIMEOUT_S = 10.0


class MediaError(ValueError):
    """An image or video a request names cannot be used."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class MediaRef:
    """One image or video of a request, not read yet."""

    # "image" | "video".
    modality: str
    # An image: a URL or path string, bytes, or a PIL image. A video: a list of such frames.
    source: Any
    # The request field it came from (error messages).
    param: str


@dataclass
class MediaLimits:
    allow_remote: bool = False
    # Largest encoded image, in bytes (data: URLs, files and remote fetches).
    max_bytes: int = 32 << 20


def read_bytes(source: str, param: str, limits: MediaLimits) -> bytes:
    """The encoded bytes a URL, path or bare base64 string names."""
    if source.startswith("data:"):
        header, sep, payload = source.partition(",")
        if not sep or ";base64" not in header:
            raise MediaError("a data: URL must be base64-encoded (data:image/png;base64,...)", param)
        return _b64(payload, param)
    parsed = urllib.parse.urlparse(source)
    if parsed.scheme in ("http", "https"):
        if not limits.allow_remote:
            raise MediaError("http(s) URLs are not fetched unless the server runs with --allow-remote-media; "
                             "send the image as a data: URL (base64)", param)
        return _fetch(source, param, limits)
    if parsed.scheme == "file":
        return _read_file(urllib.parse.unquote(parsed.path), param, limits)
    if parsed.scheme and len(parsed.scheme) > 1:  # "c:" is a drive letter, not a scheme
        raise MediaError(f"unsupported URL scheme '{parsed.scheme}'; accepted: data:, file://, a local path, "
                         "http(s) with --allow-remote-media", param)
    if os.path.exists(source):
        return _read_file(source, param, limits)
    if len(source) >= 16:
        try:  # SGLang's native API also takes bare base64
            return base64.b64decode(source, validate=True)
        except (binascii.Error, ValueError):
            pass
    raise MediaError(f"no such file '{source[:200]}'; accepted: a data: URL, a file:// URL or an existing local "
                     "path, http(s) with --allow-remote-media", param)


def load_image(source: Any, param: str, limits: MediaLimits) -> Any:
    """A decoded RGB PIL image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, dict):  # {"url": ...} as OpenAI's image_url object
        source = source.get("url")
    if isinstance(source, str):
        data = read_bytes(source, param, limits)
    elif isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    else:
        raise MediaError(f"expected a URL or path string, got {type(source).__name__}", param)
    if len(data) > limits.max_bytes:
        raise MediaError(f"the image has {len(data)} bytes; accepted: at most {limits.max_bytes}", param)
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
        return image if image.mode == "RGB" else image.convert("RGB")  # no copy of an RGB image
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(f"cannot decode the image ({len(data)} bytes): {exc}", param) from None


def load_video(source: Any, param: str, limits: MediaLimits) -> list[Any]:
    """A video given as a list of frames (each one an image source): the decoded frames."""
    if not isinstance(source, (list, tuple)) or not source:
        raise MediaError("a video is a non-empty list of frames (each a data: URL, file or path)", param)
    return [load_image(frame, f"{param}[{i}]", limits) for i, frame in enumerate(source)]


def _b64(payload: str, param: str) -> bytes:
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the base64 payload is not valid base64", param) from None


def _read_file(path: str, param: str, limits: MediaLimits) -> bytes:
    try:
        size = os.path.getsize(path)
        if size > limits.max_bytes:
            raise MediaError(f"'{path}' has {size} bytes; accepted: at most {limits.max_bytes}", param)
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise MediaError(f"cannot read '{path}': {exc.strerror or exc}", param) from None


def _fetch(url: str, param: str, limits: MediaLimits) -> bytes:
    """The body of an http(s) URL: at most ``max_bytes``, within ``REMOTE_TIMEOUT_S`` in all."""
    deadline = time.monotonic() + REMOTE_TIMEOUT_S
    chunks: list[bytes] = []
    size = 0
    try:
        with urllib.request.urlopen(url, timeout=REMOTE_TIMEOUT_S) as resp:  # noqa: S310 (opt-in, http(s) only)
            while True:
                chunk = resp.read(1 << 16)
                if not chunk:
                    break
                size += len(chunk)
                if size > limits.max_bytes:
                    raise MediaError(f"{url[:200]} is larger than {limits.max_bytes} bytes", param)
                if time.monotonic() > deadline:
                    raise MediaError(f"fetching {url[:200]} took longer than {REMOTE_TIMEOUT_S:g} s", param)
                chunks.append(chunk)
    except MediaError:
        raise
    except Exception as exc:  # URLError, timeouts, HTTP errors: all the client's to fix
        raise MediaError(f"fetching {url[:200]} failed: {exc}", param) from None
    return b"".join(chunks)
