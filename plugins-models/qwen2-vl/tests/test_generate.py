"""Greedy generation through the engine (an in-process scheduler: chunked prefill, a mixed batch)
equals transformers' ``generate`` in float32, on tiny random Qwen2-VL and Qwen2.5-VL checkpoints:
one image, two images of different sizes, a video, and a text-only request in the same batch.

Prompts are built here as the Hugging Face processor builds them (vision start, the run of
image or video pad tokens, vision end), with ``Qwen2VLImageProcessorPil`` for images and the
processor's patch layout for video frames; both sides get the same ids and pixels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from engine.multimodal import MultimodalItem, apply_pad_ids, features_hash
from engine.testing.checkpoints import copy_tokenizer
from engine.testing.harness import OutputCollector, make_scheduler, submit

SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PATCH, MERGE, TEMPORAL = 4, 2, 2
MAX_NEW_TOKENS = 10
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, bos_token_id=0, eos_token_id=3,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
VISION = {
    "Qwen2VLForConditionalGeneration": dict(depth=2, embed_dim=32, num_heads=2, hidden_size=64, patch_size=PATCH),
    # windows of 2x2 merged tokens, block 1 attends to whole frames
    "Qwen2_5_VLForConditionalGeneration": dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                                               patch_size=PATCH, window_size=16, out_hidden_size=64,
                                               fullatt_block_indexes=[1], tokens_per_second=2),
}


def build_checkpoint(directory: str, architecture: str) -> Any:
    """A random tiny checkpoint with the test tokenizer plus the vision tokens; returns the tokenizer."""
    import transformers

    copy_tokenizer(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.save_pretrained(directory)
    start, end, image, video = tokenizer.convert_tokens_to_ids(SPECIAL)
    config_cls = getattr(transformers, architecture.replace("ForConditionalGeneration", "Config"))
    config = config_cls(text_config={**TEXT, "vocab_size": len(tokenizer)}, vision_config=VISION[architecture],
                        vision_start_token_id=start, vision_end_token_id=end, image_token_id=image,
                        video_token_id=video)
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)  # logits far from ties, so greedy choices are stable
    model.save_pretrained(directory)
    return tokenizer


def video_patches(frames: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized frames ``[F, C, H, W]`` in the video processor's layout: ``[t*h*w, C*T*P*P]``
    patches (``T`` consecutive frames per patch, merge blocks together) and the grid ``[1, 3]``."""
    f, c, h, w = frames.shape
    t, gh, gw = f // TEMPORAL, h // PATCH, w // PATCH
    x = frames.reshape(t, TEMPORAL, c, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * gh * gw, c * TEMPORAL * PATCH * PATCH)
    return torch.from_numpy(np.ascontiguousarray(x)), torch.tensor([[t, gh, gw]])


class Prompts:
    def __init__(self, tokenizer: Any, video_seconds: float | None) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.tokenizer = tokenizer
        self.ids = dict(zip(SPECIAL, tokenizer.convert_tokens_to_ids(SPECIAL), strict=True))
        self.images = Qwen2VLImageProcessorPil(min_pixels=64, max_pixels=32 * 32, patch_size=PATCH, merge_size=MERGE,
                                               temporal_patch_size=TEMPORAL)
        self.rng = np.random.default_rng(0)
        # Qwen2.5-VL's processor gives each video the time its temporal patches span.
        self.video_seconds = video_seconds

    def image(self, h: int, w: int) -> Any:
        from PIL import Image

        return Image.fromarray((self.rng.random((h, w, 3)) * 255).astype("uint8"))

    def video(self, frames: int, h: int, w: int) -> np.ndarray:
        return self.rng.standard_normal((frames, 3, h, w)).astype(np.float32)

    def build(self, parts: list[Any]) -> tuple[list[int], list[MultimodalItem]]:
        """Chat prompt ids with each image/video's placeholder run, and its items."""
        text = lambda s: self.tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
        ids, items = text("<|im_start|>user\n"), []
        for part in parts:
            if isinstance(part, str):
                ids += text(part)
                continue
            if isinstance(part, np.ndarray):
                pixels, grid = video_patches(part)
                features = {"pixel_values_videos": pixels, "video_grid_thw": grid}
                if self.video_seconds is not None:
                    features["second_per_grid_ts"] = torch.tensor([self.video_seconds])
                modality, pad = "video", self.ids["<|video_pad|>"]
            else:
                out = self.images(images=[part], return_tensors="pt")
                features = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
                modality, pad = "image", self.ids["<|image_pad|>"]
            length = int(next(v for k, v in features.items() if k.endswith("grid_thw")).prod()) // MERGE**2
            ids.append(self.ids["<|vision_start|>"])
            items.append(MultimodalItem(modality, features_hash(modality, features), len(ids), length, features))
            ids += [pad] * length + [self.ids["<|vision_end|>"]]
        return ids + text("<|im_end|>\n<|im_start|>assistant\n"), items


def hf_greedy(model: Any, ids: list[int], items: list[MultimodalItem], pad_ids: dict[str, int]) -> list[int]:
    tokens = torch.tensor([ids])
    types = torch.zeros_like(tokens)
    types[tokens == pad_ids["<|image_pad|>"]] = 1
    types[tokens == pad_ids["<|video_pad|>"]] = 2
    inputs: dict[str, Any] = {}
    for item in items:
        for key, value in item.features.items():
            inputs.setdefault(key, []).append(value)
    inputs = {k: torch.cat(v) for k, v in inputs.items()}
    with torch.no_grad():
        out = model.generate(tokens, attention_mask=torch.ones_like(tokens), mm_token_type_ids=types,
                             do_sample=False, max_new_tokens=MAX_NEW_TOKENS, **inputs)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module", params=list(VISION), ids=["qwen2-vl", "qwen2.5-vl"])
def checkpoint(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Any]:
    directory = str(tmp_path_factory.mktemp(request.param))
    return request.param, directory, build_checkpoint(directory, request.param)


@pytest.fixture(scope="module")
def hf_model(checkpoint: tuple[str, str, Any]) -> Any:
    import transformers

    architecture, directory, _ = checkpoint
    return getattr(transformers, architecture).from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def scheduler(checkpoint: tuple[str, str, Any]) -> Any:
    # Chunks of 32 tokens cut the image and video runs.
    return make_scheduler(checkpoint[1], chunked_prefill_size=32)


def test_decoder_logits_with_three_section_positions(hf_model: Any, scheduler: Any) -> None:
    """Text through the decoder at arbitrary (temporal, height, width) positions: the last
    position's logits agree with transformers' text forward given the same position ids."""
    from engine.model_executor.forward_batch import ForwardBatch, ForwardMode

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 2048, (23,), generator=gen).tolist()
    positions = torch.randint(0, 300, (3, len(ids)), generator=gen)
    runner = scheduler.runner
    slots = runner.req_to_token_pool.alloc(1)
    loc = runner.token_to_kv_pool_allocator.alloc_extend([0], [len(ids)], [-1])
    runner.req_to_token_pool.write(slots[0], 0, loc)
    batch = ForwardBatch.build(ForwardMode.EXTEND, ids, slots, [len(ids)], [0], loc, runner.device)
    batch.mrope_positions = positions
    try:
        ours = runner.forward(batch)
    finally:
        runner.token_to_kv_pool_allocator.free(loc)
        runner.req_to_token_pool.free(slots)
    with torch.no_grad():
        want = hf_model(torch.tensor([ids]), position_ids=positions[:, None, :]).logits[0, -1]
    torch.testing.assert_close(ours.next_token_logits[0].float(), want, atol=1e-4, rtol=1e-4)


def test_greedy_matches_transformers(checkpoint: tuple[str, str, Any], hf_model: Any, scheduler: Any) -> None:
    architecture, _, tokenizer = checkpoint
    prompts = Prompts(tokenizer, 0.5 if architecture.startswith("Qwen2_5") else None)
    requests = {
        "one image": prompts.build(["describe ", prompts.image(24, 32), " briefly"]),
        "two images": prompts.build([prompts.image(16, 16), " and ", prompts.image(40, 24), " differ how?"]),
        "video": prompts.build(["watch ", prompts.video(4, 16, 24), " then tell"]),
        "text only": prompts.build(["no picture here"]),
    }
    want = {name: hf_greedy(hf_model, ids, items, prompts.ids) for name, (ids, items) in requests.items()}
    vocab = scheduler.runner.vocab_size
    params = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0}
    # All four requests run in one batch.
    rids = {name: submit(scheduler, apply_pad_ids(ids, items, vocab), params, mm_items=items)
            for name, (ids, items) in requests.items()}
    collector = OutputCollector()
    while scheduler.step():
        collector.collect(scheduler)
    collector.collect(scheduler)
    got = {name: collector.ids.get(rid, []) for name, rid in rids.items()}
    assert got == want
