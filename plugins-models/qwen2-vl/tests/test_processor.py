"""``Qwen2VLProcessorPil``: the video patch layout, placeholder expansion and its errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from engine_models_qwen2_vl.processor import Qwen2VLProcessorPil
from engine_models_qwen2_vl.testing import write_processor_files
from PIL import Image


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory) -> Qwen2VLProcessorPil:
    directory = str(tmp_path_factory.mktemp("qwen2-vl-processor"))
    write_processor_files(directory, patch_size=4, min_pixels=64, max_pixels=32 * 32)
    return Qwen2VLProcessorPil.from_pretrained(directory)


def _frames(n: int, h: int, w: int) -> list[Any]:
    rng = np.random.default_rng(n)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(n)]


def test_video_patches_follow_the_video_layout(processor: Qwen2VLProcessorPil) -> None:
    """Row ``(t, block row, block column, row in block, column in block)``, values
    ``(channel, frame in patch, y, x)``; an odd last frame is repeated."""
    frames = _frames(3, 16, 24)  # sizes already multiples of 8: no resize
    patches, grid = processor.video_patches(frames)
    assert grid.tolist() == [[2, 4, 6]] and patches.shape == (2 * 4 * 6, 3 * 2 * 4 * 4)
    ip = processor.image_processor
    mean = np.asarray(ip.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(ip.image_std, dtype=np.float32)[:, None, None]
    scale = np.float32(ip.rescale_factor)
    # float32 arithmetic per value: the processor's value table must reproduce it exactly.
    pixels = [(np.asarray(f, dtype=np.float32).transpose(2, 0, 1) * scale - mean) / std for f in frames]
    pixels.append(pixels[-1])
    row = 0
    for t in range(2):
        for by in range(2):
            for bx in range(3):
                for my in range(2):
                    for mx in range(2):
                        y, x = (by * 2 + my) * 4, (bx * 2 + mx) * 4
                        want = np.stack([pixels[2 * t + k][:, y:y + 4, x:x + 4] for k in range(2)], axis=1)
                        np.testing.assert_array_equal(patches[row].numpy(), want.reshape(-1))
                        row += 1


def test_placeholders_expand_to_each_items_tokens(processor: Qwen2VLProcessorPil) -> None:
    prompt = "a <|image_pad|> b <|video_pad|> c <|image_pad|>"
    out = processor(text=[prompt], images=_frames(2, 16, 16), videos=[_frames(2, 8, 16)], add_special_tokens=False)
    ids = out["input_ids"][0]
    image, video = processor.tokenizer.convert_tokens_to_ids([processor.image_token, processor.video_token])
    assert int((ids == image).sum()) == 2 * 4 and int((ids == video).sum()) == 2
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]] * 2 and out["video_grid_thw"].tolist() == [[1, 2, 4]]
    assert out["pixel_values"].dtype == torch.float32


def test_placeholders_must_match_the_items(processor: Qwen2VLProcessorPil) -> None:
    with pytest.raises(ValueError, match="more '<\\|image_pad\\|>' placeholders than items"):
        processor(text=["<|image_pad|><|image_pad|>"], images=_frames(1, 16, 16))
    with pytest.raises(ValueError, match="1 item\\(s\\) have no '<\\|image_pad\\|>' placeholder"):
        processor(text=["<|image_pad|>"], images=_frames(2, 16, 16))


@pytest.mark.parametrize("patch_size, limits, sizes", [
    (4, (64, 32 * 32), [(16, 16), (37, 53), (90, 20)]),  # the fixture's limits: images shrink
    (14, (56 * 56, 28 * 28 * 1280), [(150, 97), (3, 420), (28, 28)]),  # Qwen2-VL's defaults: grow and cut
])
def test_image_pixels_equal_transformers(patch_size: int, limits: tuple[int, int],
                                         sizes: list[tuple[int, int]]) -> None:
    """The plugin's uint8 patching and value table give transformers' exact float32 pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ip = Qwen2VLImageProcessorPil(patch_size=patch_size, min_pixels=limits[0], max_pixels=limits[1])
    rng = np.random.default_rng(patch_size)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    want = ip(images=images, return_tensors="pt")
    pixels, grid = Qwen2VLProcessorPil(None, ip).image_pixels(images)
    assert torch.equal(grid, want["image_grid_thw"])
    assert pixels.dtype == torch.float32 and torch.equal(pixels, want["pixel_values"])
