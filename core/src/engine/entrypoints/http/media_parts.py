"""Image and video content parts of chat messages.

OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}`` (or the URL as a bare string), and
for video a list of frames: ``{"type": "video_url", "video_url": {"url": [frame, ...]}}`` or
``{"type": "video", "video": [frame, ...]}``. Each becomes an ``{"type": "image"}`` /
``{"type": "video"}`` part of the conversation the chat template sees, and a ``MediaRef`` the
tokenizer workers read (``engine.managers.tokenizer_mm``).
"""

from __future__ import annotations

from typing import Any

from engine.entrypoints.http.errors import APIError

_IMAGE_PARTS = ("image_url", "input_image", "image")
_VIDEO_PARTS = ("video_url", "video")


def is_media_part(kind: str) -> bool:
    return kind in _IMAGE_PARTS or kind in _VIDEO_PARTS


def media_part(part: Any, where: str, media: list[Any]) -> dict[str, Any]:
    """The template's part for one image/video content part; its source is appended to ``media``."""
    from engine.multimodal.media import MediaRef

    kind = part.type
    extra = part.model_extra or {}
    modality = "image" if kind in _IMAGE_PARTS else "video"
    value = extra.get(kind)
    if isinstance(value, dict):
        value = value.get("url")
    if kind == "input_image" and value is None:  # the Responses API's shape: image_url is the URL
        value = extra.get("image_url")
    if modality == "image" and not isinstance(value, str):
        raise APIError(400, f"{where}.{kind}: expected {{\"url\": \"data:image/...;base64,...\"}} or a URL string",
                       param=f"{where}.{kind}")
    if modality == "video" and not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        raise APIError(400, f"{where}.{kind}: a video is a non-empty list of frame URLs "
                            "({\"url\": [\"data:image/...\", ...]})", param=f"{where}.{kind}")
    media.append(MediaRef(modality, value, f"{where}.{kind}"))
    return {"type": modality}
