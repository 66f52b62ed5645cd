"""The tokenizer side's cost savers: an item's hash from its decoded pixels (equal for equal
images, different for different ones or another processor), and the processor's tokenizer as
the only locked part, so that concurrent requests process their images in parallel."""

from __future__ import annotations

import base64
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from engine.multimodal.items import media_hash
from engine.multimodal.media import MediaLimits, MediaRef
from engine.multimodal.processor import MultimodalProcessor, _LockedTokenizer

from .conftest import png_data_url


@pytest.fixture(scope="module")
def processor(llava_ckpt: str) -> MultimodalProcessor:
    return MultimodalProcessor(llava_ckpt, 512, 4, MediaLimits())


def _hashes(processor: MultimodalProcessor, *sources: Any) -> list[int]:
    refs = [MediaRef("image", s, f"image_data[{i}]") for i, s in enumerate(sources)]
    _, items = processor.process("a " + " b ".join(["<image>"] * len(refs)), refs, True, "prompt")
    return [it.hash for it in items]


def test_equal_pixels_hash_equal_and_different_pixels_differ(processor: MultimodalProcessor) -> None:
    one, two = png_data_url(1), png_data_url(2)
    decoded = Image.open(io.BytesIO(base64.b64decode(one.partition(",")[2])))
    first, second, again = _hashes(processor, one, two, one)
    assert first == again != second
    # The same pixels as a PIL image, and the same image sent again in another request.
    assert _hashes(processor, decoded) == [first] and _hashes(processor, one) == [first]
    # One pixel changed.
    pixels = np.asarray(decoded).copy()
    pixels[0, 0, 0] ^= 1
    assert _hashes(processor, Image.fromarray(pixels)) != [first]


def test_the_processor_and_the_features_layout_are_part_of_the_hash() -> None:
    frame = Image.fromarray(np.zeros((4, 6, 3), dtype=np.uint8))
    features = {"pixel_values": torch.zeros(1, 3, 4, 4)}
    base = media_hash("image", [frame], features, b"a")
    assert media_hash("image", [frame], features, b"a") == base
    assert media_hash("image", [frame], features, b"b") != base
    assert media_hash("video", [frame], features, b"a") != base
    assert media_hash("image", [frame], {"pixel_values": torch.zeros(1, 3, 2, 8)}, b"a") != base
    # Same bytes, other shape: 4x6 and 6x4 images.
    assert media_hash("image", [Image.fromarray(np.zeros((6, 4, 3), dtype=np.uint8))], features, b"a") != base


class _OneAtATime:
    """A tokenizer that fails when two threads are inside it at once."""

    def __init__(self) -> None:
        self.inside = 0
        self.overlaps = 0
        self.padding_side = "right"

    def __call__(self, text: str) -> list[int]:
        self.inside += 1
        self.overlaps += self.inside > 1
        time.sleep(0.01)
        self.inside -= 1
        return [len(text)]

    def encode(self, text: str) -> list[int]:
        return self(text)


def test_the_locked_tokenizer_serialises_calls_and_passes_attributes() -> None:
    inner = _OneAtATime()
    locked = _LockedTokenizer(inner)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: locked("x" * i) + locked.encode("y" * i), range(12)))
    assert results == [[i, i] for i in range(12)] and inner.overlaps == 0
    assert locked.padding_side == "right"
    locked.padding_side = "left"
    assert inner.padding_side == "left"


def test_concurrent_requests_give_the_serial_results(processor: MultimodalProcessor) -> None:
    urls = [png_data_url(seed, size=30 + seed) for seed in range(6)]
    serial = [processor.process("x <image> y", [MediaRef("image", u, "image_data[0]")], True, "prompt") for u in urls]
    barrier = threading.Barrier(3)

    def run(url: str) -> Any:
        barrier.wait(timeout=30) if url in urls[:3] else None
        return processor.process("x <image> y", [MediaRef("image", url, "image_data[0]")], True, "prompt")

    with ThreadPoolExecutor(3) as pool:
        parallel = list(pool.map(run, urls))
    for (ids, items), (pids, pitems) in zip(serial, parallel):
        assert ids == pids and [it.hash for it in items] == [it.hash for it in pitems]
        assert all(torch.equal(a.features[k], b.features[k]) for a, b in zip(items, pitems) for k in a.features)
