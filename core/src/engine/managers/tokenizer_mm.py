"""The tokenizer manager's images and video: the model's processor, run on the tokenizer pool.

``TokenizerManager`` takes this mixin; the chat route and ``/generate`` (``image_data``,
``video_data``) hand their media here, and a request leaves with ``mm_items`` beside its ids.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

from engine.managers.request_state import RequestError

if TYPE_CHECKING:
    from engine.multimodal.items import MultimodalItem
    from engine.multimodal.media import MediaRef
    from engine.multimodal.processor import MultimodalProcessor

# Media jobs always go to a worker thread: decoding and resizing an image is milliseconds of CPU.
_MEDIA_JOB_SIZE = 1 << 16


class MultimodalMixin:
    args: Any
    model_path: str
    ready: Any
    pool: Any

    @functools.cached_property
    def mm_processor(self) -> MultimodalProcessor | None:
        """The model's processor (None on a text-only model), loaded on first use."""
        if not getattr(self.ready, "multimodal", False):
            return None
        from engine.multimodal.media import MediaLimits
        from engine.multimodal.processor import MultimodalProcessor

        args = self.args
        return MultimodalProcessor(
            getattr(args, "tokenizer_path", None) or self.model_path, self.ready.vocab_size,
            getattr(args, "limit_mm_per_prompt", 16),
            MediaLimits(getattr(args, "allow_remote_media", False), getattr(args, "max_body_bytes", 32 << 20)),
            getattr(args, "trust_remote_code", False))

    def check_takes_media(self, param: str, modality: str = "image") -> None:
        """A RequestError naming ``param`` unless the model takes images (checked without loading
        the processor: that happens on a tokenizer worker)."""
        if not getattr(self.ready, "multimodal", False):
            name = os.path.basename(os.path.normpath(self.model_path))
            raise RequestError(f"{param}: this model ({name}) takes no {modality} input; accepted: text only "
                               "(serve a vision-language model for images)", param)

    def require_mm_processor(self, param: str, modality: str = "image") -> MultimodalProcessor:
        self.check_takes_media(param, modality)
        processor = self.mm_processor
        assert processor is not None
        return processor

    def process_media_sync(self, prompt: str, media: list[MediaRef], add_special_tokens: bool,
                           where: str) -> tuple[list[int], list[MultimodalItem]]:
        """Prompt ids and items; a bad image or too many are a RequestError naming the field."""
        from engine.multimodal.media import MediaError

        processor = self.require_mm_processor(media[0].param if media else where,
                                              media[0].modality if media else "image")
        try:
            return processor.process(prompt, media, add_special_tokens, where)
        except MediaError as exc:
            raise RequestError(str(exc), exc.param) from None

    async def process_media(self, prompt: str, media: list[MediaRef], add_special_tokens: bool,
                            where: str) -> tuple[list[int], list[MultimodalItem]]:
        return await self.pool.run(self.process_media_sync, _MEDIA_JOB_SIZE, prompt, media, add_special_tokens, where)

    def render_chat_media_sync(self, conversation: list[dict[str, Any]], media: list[MediaRef],
                               add_generation_prompt: bool, template_kwargs: dict[str, Any],
                               tokenizer: Any) -> tuple[list[int], list[MultimodalItem]]:
        """A chat with image/video parts: the prompt with placeholders, then ids and items."""
        from engine.multimodal.media import MediaError

        processor = self.require_mm_processor(media[0].param, media[0].modality)
        try:
            processor.check(media, "messages")
            prompt = processor.render_chat(conversation, add_generation_prompt, template_kwargs, tokenizer)
        except MediaError as exc:
            raise RequestError(str(exc), exc.param) from None
        return self.process_media_sync(prompt, media, False, "messages")

    async def render_chat_media(self, conversation: list[dict[str, Any]], media: list[MediaRef],
                                add_generation_prompt: bool, template_kwargs: dict[str, Any],
                                tokenizer: Any) -> tuple[list[int], list[MultimodalItem]]:
        return await self.pool.run(self.render_chat_media_sync, _MEDIA_JOB_SIZE, conversation, media,
                                   add_generation_prompt, template_kwargs, tokenizer)


def native_media(image_data: Any, video_data: Any) -> list[MediaRef]:
    """``/generate``'s ``image_data`` (one source or a list) and ``video_data`` (one video's frames,
    or a list of videos) as media references."""
    from engine.multimodal.media import MediaRef

    refs = []
    if image_data is not None:
        images = image_data if isinstance(image_data, list) else [image_data]
        refs += [MediaRef("image", s, f"image_data[{i}]" if isinstance(image_data, list) else "image_data")
                 for i, s in enumerate(images)]
    if video_data is not None:
        if not isinstance(video_data, list) or not video_data:
            raise RequestError("video_data: expected a list of frames, or a list of such lists", "video_data")
        videos = video_data if isinstance(video_data[0], list) else [video_data]
        refs += [MediaRef("video", v, f"video_data[{i}]" if videos is video_data else "video_data")
                 for i, v in enumerate(videos)]
    return refs
