"""What a request carries to the scheduler for each image or video: ``MultimodalItem``.

The tokenizer side (``engine.multimodal.processor``) runs the model's Hugging Face processor,
which expands each image's placeholder into the run of tokens the model replaces with the
image's embeddings. Each item records where that run sits and what the processor produced for
it; the ids of the run are then replaced by *pad ids* derived from the item's hash, so the
radix cache shares the KV of two requests with the same image and never of two with different
images (``pad_ids``).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MODALITIES = ("image", "video")


@dataclass
class MultimodalItem:
    """One image or video of a request, as the model plugin receives it."""

    # "image" | "video".
    modality: str
    # 63-bit hash of the item (its pixels and how they were processed): equal for the same image
    # processed the same way, so equal hashes mean equal features and embeddings.
    hash: int
    # First prompt position of the item's placeholder tokens.
    offset: int
    # Number of placeholder tokens (the rows of the item's embedding).
    length: int
    # What the processor produced for this item alone, e.g. ``pixel_values`` [1, 3, H, W] (LLaVA)
    # or ``pixel_values`` [patches, dim] and ``image_grid_thw`` [1, 3] (Qwen2-VL).
    features: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.offset + self.length

    def feature_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.features.values())


def features_hash(modality: str, features: dict[str, Any]) -> int:
    """A 63-bit hash of an item's processed features (names, shapes, dtypes and bytes)."""
    digest = hashlib.blake2b(modality.encode(), digest_size=8)
    _update_features(digest, features)
    for name in sorted(features):
        # The tensor's own memory, not a copy of it (blake2b reads any buffer).
        digest.update(features[name].detach().contiguous().cpu().view(-1).view(dtype=_byte_dtype()).numpy())
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


def media_hash(modality: str, frames: list[Any], features: dict[str, Any], processor_key: bytes) -> int:
    """A 63-bit hash of an item from its decoded pixels: the RGB frames (PIL images), the
    processor that made its features (``processor_key``: its class and settings) and the
    features' names, shapes and dtypes.

    The features are a function of those, so equal hashes still mean equal features, at a
    quarter of the bytes of hashing float32 features (3 bytes a pixel before resizing).
    """
    digest = hashlib.blake2b(modality.encode() + b"\0" + processor_key, digest_size=8)
    _update_features(digest, features)
    for frame in frames:
        digest.update(f"{frame.mode}:{frame.width}x{frame.height};".encode())
        digest.update(frame.tobytes())
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


def _update_features(digest: Any, features: dict[str, Any]) -> None:
    for name in sorted(features):
        tensor = features[name]
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())


def _byte_dtype() -> Any:
    import torch

    return torch.uint8


def pad_ids(item_hash: int, length: int, vocab_size: int) -> list[int]:
    """The ids standing in for an item's placeholder run: a pseudo-random sequence seeded by the
    hash, inside the vocabulary.

    Inside the vocabulary so that every consumer of prompt ids (penalties, prompt logprobs, the
    detokenizer's context) keeps working unchanged; the model never embeds them (the runtime
    scatters the item's embedding over those positions). A different image gives a different
    sequence at almost every position, so two runs collide only with probability about
    ``vocab_size ** -length``.
    """
    rng = random.Random(item_hash)
    return [rng.randrange(vocab_size) for _ in range(length)]


def apply_pad_ids(input_ids: list[int], items: list[MultimodalItem], vocab_size: int) -> list[int]:
    """``input_ids`` with each item's placeholder run replaced by its pad ids."""
    out = list(input_ids)
    for item in items:
        out[item.offset:item.end] = pad_ids(item.hash, item.length, vocab_size)
    return out
