"""The tokenizer side of images and video: the model's Hugging Face processor (chat template
with placeholders, decoding, resizing, placeholder expansion) turned into prompt ids and
``MultimodalItem``s. Runs on the tokenizer workers (``TokenizerPool.run``), off the event loop.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from engine.multimodal.items import MultimodalItem, apply_pad_ids, media_hash
from engine.multimodal.media import MediaError, MediaLimits, MediaRef, load_image, load_video

logger = logging.getLogger(__name__)

# Processor outputs that describe the text, not an item.
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


class MultimodalProcessor:
    """One model's processor with the limits of the server."""

    def __init__(self, model_path: str, vocab_size: int, limit_per_prompt: int, limits: MediaLimits,
                 trust_remote_code: bool = False) -> None:
        from transformers import AutoProcessor

        own = _model_processor_loader(model_path)
        if own is not None:
            self.processor = own(model_path, trust_remote_code=trust_remote_code)
        else:
            # torchvision-backed ("fast") image processors are not required: the PIL/numpy ones.
            try:
                self.processor = AutoProcessor.from_pretrained(model_path, backend="pil",
                                                               trust_remote_code=trust_remote_code)
            except TypeError:  # transformers before 5 names the choice use_fast
                self.processor = AutoProcessor.from_pretrained(model_path, use_fast=False,
                                                               trust_remote_code=trust_remote_code)
        self.tokenizer = getattr(self.processor, "tokenizer", None)
        # The tokenizer workers share this processor; a fast tokenizer used from two threads at
        # once can fail ("Already borrowed") when a call changes its padding/truncation state.
        # Only the processor's tokenizer is locked: decoding, resizing and normalizing the
        # images of concurrent requests run in parallel (PIL and numpy release the GIL).
        if self.tokenizer is not None:
            self.processor.tokenizer = _LockedTokenizer(self.tokenizer)
        self.processor_key = _processor_key(self.processor)
        self.vocab_size = vocab_size
        self.limit_per_prompt = limit_per_prompt
        self.limits = limits
        self.token_ids = {m: self._token_id(getattr(self.processor, f"{m}_token", None)) for m in ("image", "video")}
        self.modalities = tuple(m for m, t in self.token_ids.items()
                                if t is not None and getattr(self.processor, f"{m}_processor", None) is not None)

    def _token_id(self, token: str | None) -> int | None:
        if token is None or self.tokenizer is None:
            return None
        tid = self.tokenizer.convert_tokens_to_ids(token)
        return tid if isinstance(tid, int) and tid != getattr(self.tokenizer, "unk_token_id", None) else None

    def placeholder(self, modality: str) -> str:
        return str(getattr(self.processor, f"{modality}_token"))

    def check(self, media: list[MediaRef], where: str) -> None:
        """The request's media fit this model and the per-prompt limit (before any decoding)."""
        if len(media) > self.limit_per_prompt:
            raise MediaError(f"{len(media)} images and videos; accepted: at most {self.limit_per_prompt} per request "
                             "(--limit-mm-per-prompt)", where)
        for ref in media:
            if ref.modality not in self.modalities:
                raise MediaError(f"this model takes no {ref.modality} input; accepted: "
                                 f"{', '.join(self.modalities)}", ref.param)

    # -- prompts ---------------------------------------------------------------
    def render_chat(self, conversation: list[dict[str, Any]], add_generation_prompt: bool,
                    template_kwargs: dict[str, Any], text_tokenizer: Any) -> str:
        """The chat prompt with each image/video part where the template puts its placeholder.

        The processor's own chat template when it writes one placeholder per part (it knows the
        model's markup, e.g. Qwen2-VL's vision start/end tokens); else the tokenizer's template
        with each part replaced by the processor's placeholder token in the text.
        """
        if getattr(self.processor, "chat_template", None):
            prompt = self.processor.apply_chat_template(conversation, tokenize=False,
                                                        add_generation_prompt=add_generation_prompt,
                                                        **template_kwargs)
            parts = [p["type"] for m in conversation if isinstance(m.get("content"), list) for p in m["content"]]
            if all(prompt.count(self.placeholder(m)) == parts.count(m) for m in set(parts) - {"text"}):
                return prompt
        flat = []
        for message in conversation:
            content = message.get("content")
            if isinstance(content, list):
                texts = [p["text"] if p["type"] == "text" else self.placeholder(p["type"]) for p in content]
                message = {**message, "content": "\n".join(texts)}
            flat.append(message)
        return text_tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **template_kwargs)

    def process(self, prompt: str, media: list[MediaRef], add_special_tokens: bool,
                where: str) -> tuple[list[int], list[MultimodalItem]]:
        """Prompt ids (placeholders expanded, then replaced by pad ids) and the items, in prompt order."""
        self.check(media, where)
        images = [load_image(r.source, r.param, self.limits) for r in media if r.modality == "image"]
        videos = [load_video(r.source, r.param, self.limits) for r in media if r.modality == "video"]
        for modality, found in (("image", images), ("video", videos)):
            count = prompt.count(self.placeholder(modality)) if found else 0
            if found and count != len(found):
                raise MediaError(f"the prompt holds {count} {modality} placeholder(s) "
                                 f"('{self.placeholder(modality)}') for {len(found)} {modality}(s)", where)
        kwargs: dict[str, Any] = {"text": [prompt], "return_tensors": "pt", "add_special_tokens": add_special_tokens}
        if images:
            kwargs["images"] = images
        if videos:
            kwargs["videos"] = videos
        try:
            out = self.processor(**kwargs)
        except MediaError:
            raise
        except Exception as exc:  # the processor's own refusal: a size it cannot take, a frame count...
            first = media[0].param if media else where
            raise MediaError(f"the model's processor refused the input: {exc}", first) from None
        ids = out["input_ids"][0].tolist()
        items = []
        for modality, found in (("image", [[image] for image in images]), ("video", videos)):
            if found:
                items += self._items(modality, found, ids, out, where)
        items.sort(key=lambda it: it.offset)
        return apply_pad_ids(ids, items, self.vocab_size), items

    def _items(self, modality: str, frames: list[list[Any]], ids: list[int], out: Any,
               where: str) -> list[MultimodalItem]:
        """One item per image (one frame) or video, in prompt order: the processor expands the
        placeholders in the order it was given the media."""
        count = len(frames)
        runs = _runs(ids, self.token_ids[modality])
        if len(runs) != count:
            total = sum(n for _, n in runs)
            if len(runs) != 1 or total % count:
                raise MediaError(f"found {len(runs)} runs of {modality} tokens for {count} {modality}(s)", where)
            start, _ = runs[0]  # adjacent items with no text between: equal shares
            runs = [(start + i * total // count, total // count) for i in range(count)]
        features = _split_features(modality, count, {k: v for k, v in out.items() if k not in _TEXT_KEYS})
        return [MultimodalItem(modality, media_hash(modality, pixels, f, self.processor_key), offset, length, f)
                for (offset, length), f, pixels in zip(runs, features, frames)]


class _LockedTokenizer:
    """A tokenizer whose calls hold one lock; everything else passes through."""

    def __init__(self, tokenizer: Any) -> None:
        self.__dict__["_tokenizer"] = tokenizer
        self.__dict__["_lock"] = threading.RLock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("_tokenizer", "_lock"):  # a copy made without __init__: no recursion
            raise AttributeError(name)
        value = getattr(self._tokenizer, name)
        if not callable(value) or isinstance(value, type):
            return value
        lock = self._lock

        def locked(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return value(*args, **kwargs)

        return locked

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._tokenizer, name, value)

    def __len__(self) -> int:
        return len(self._tokenizer)


def _processor_key(processor: Any) -> bytes:
    """The processor's class and its image and video settings: what, besides the pixels,
    decides an item's features (part of its hash)."""
    parts = [f"{type(processor).__module__}.{type(processor).__qualname__}"]
    for name in ("image_processor", "video_processor"):
        sub = getattr(processor, name, None)
        if sub is None or sub is processor:
            continue
        to_json = getattr(sub, "to_json_string", None)
        parts.append(f"{name}={type(sub).__qualname__}:{to_json() if callable(to_json) else ''}")
    return "\n".join(parts).encode()


def _model_processor_loader(model_path: str) -> Any:
    """The model class's ``load_processor(path, trust_remote_code=False)`` when its plugin provides
    one (a processor transformers cannot build here: Qwen2-VL's needs torchvision for its video
    processor), else None. The class is the one the checkpoint's ``architectures`` selects."""
    import json
    import os

    import engine.plugins as plugins

    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            architecture = (json.load(f).get("architectures") or [None])[0]
    except (OSError, ValueError):
        return None  # a tokenizer directory without config.json: the Hugging Face processor
    if architecture not in plugins.model_architectures():
        return None
    cls = plugins.model_class_of(plugins.get_model_spec(architecture), architecture)
    return getattr(cls, "load_processor", None)


def _runs(ids: list[int], token_id: int | None) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] == token_id:
            j = i
            while j < len(ids) and ids[j] == token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def _is_video_key(key: str) -> bool:
    # Qwen2.5-VL's seconds per temporal patch belong to its videos though the name does not say so.
    return "video" in key or key == "second_per_grid_ts"


def _split_features(modality: str, count: int, outputs: dict[str, Any]) -> list[dict[str, Any]]:
    """The processor's batched outputs for one modality, as one dict per item.

    Two layouts exist: one row per item (LLaVA's ``pixel_values`` [n, 3, H, W]), and patches of
    all items concatenated with a ``*_grid_thw`` [n, 3] saying how many each has (Qwen2-VL).
    """
    mine = {k: v for k, v in outputs.items() if _is_video_key(k) == (modality == "video") and hasattr(v, "shape")}
    grid = next((v for k, v in mine.items() if k.endswith("grid_thw")), None)
    sizes = [int(g.prod()) for g in grid] if grid is not None else None
    parts: list[dict[str, Any]] = [{} for _ in range(count)]
    for key, value in mine.items():
        if sizes is not None and not key.endswith("grid_thw") and value.shape[0] == sum(sizes):
            chunks = list(value.split(sizes))
        elif value.shape[0] == count:
            chunks = list(value.split(1))
        else:
            raise MediaError(f"cannot split the processor's '{key}' of shape {tuple(value.shape)} over "
                             f"{count} {modality}(s)", "model")
        for part, chunk in zip(parts, chunks):
            part[key] = chunk.contiguous()
    return parts
