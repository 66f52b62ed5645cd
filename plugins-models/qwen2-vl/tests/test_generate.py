"""Tiny random Qwen2-VL and Qwen2.5-VL checkpoints (tokenizer with the vision tokens, chat template,
image processor config) through the engine: chat prompts with images and video rendered and
processed by the runtime's ``MultimodalProcessor`` (the plugin's PIL processor), run on an
in-process scheduler (32-token chunks cut the image and video runs; one batch mixes them with a
text-only request). Greedy output equals transformers' ``generate`` in float32 on the same ids
and pixels, and the decoder's logits at three-section positions equal transformers' text forward.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
import torch
from engine_models_qwen2_vl.testing import TINY_VISION, make_tiny_checkpoint

from engine.managers.io_struct import TokenizedGenerateReqInput
from engine.managers.scheduler import check_no_leak
from engine.multimodal.media import MediaLimits, MediaRef, load_image
from engine.multimodal.processor import MultimodalProcessor
from engine.testing.harness import make_scheduler

NEW_TOKENS = 10


def png(seed: int, height: int, width: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module", params=list(TINY_VISION), ids=["qwen2-vl", "qwen2.5-vl"])
def setup(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import transformers

    directory = make_tiny_checkpoint(str(tmp_path_factory.mktemp(request.param)), request.param)
    scheduler = make_scheduler(directory, chunked_prefill_size=32)
    processor = MultimodalProcessor(directory, scheduler.runner.vocab_size, 4, MediaLimits())
    hf = getattr(transformers, request.param).from_pretrained(directory, dtype=torch.float32).eval()
    return scheduler, processor, hf


def chat(processor: MultimodalProcessor, parts: list[Any]) -> tuple[str, list[MediaRef]]:
    """A one-message chat prompt of text, ``("image", url)`` and ``("video", [frame urls])`` parts."""
    content, media = [], []
    for i, part in enumerate(parts):
        if isinstance(part, str):
            content.append({"type": "text", "text": part})
        else:
            content.append({"type": part[0]})
            media.append(MediaRef(part[0], part[1], f"messages[0].content[{i}]"))
    prompt = processor.render_chat([{"role": "user", "content": content}], True, {}, processor.tokenizer)
    return prompt, media


def reference(setup: Any, prompt: str, media: list[MediaRef]) -> list[int]:
    """transformers' greedy tokens on the processor's ids and pixels."""
    _, processor, hf = setup
    limits = MediaLimits()
    images = [load_image(m.source, m.param, limits) for m in media if m.modality == "image"]
    videos = [[load_image(f, m.param, limits) for f in m.source] for m in media if m.modality == "video"]
    inputs = processor.processor(text=[prompt], images=images or None, videos=videos or None, return_tensors="pt",
                                 add_special_tokens=False)
    ids = inputs["input_ids"]
    types = torch.zeros_like(ids)
    types[ids == processor.token_ids["image"]] = 1
    types[ids == processor.token_ids["video"]] = 2
    with torch.no_grad():
        out = hf.generate(**inputs, mm_token_type_ids=types, do_sample=False, max_new_tokens=NEW_TOKENS)
    return out[0, ids.shape[1]:].tolist()


def run(setup: Any, requests: dict[str, list[Any]]) -> dict[str, tuple[list[int], int, list[int]]]:
    """Runs the chat requests together: per request, its output ids, cached prompt tokens and
    transformers' greedy ids."""
    scheduler, processor, _ = setup
    results: dict[str, Any] = {}
    for rid, parts in requests.items():
        prompt, media = chat(processor, parts)
        ids, items = processor.process(prompt, media, False, "messages")
        assert [it.modality for it in items] == [m.modality for m in media]
        scheduler.add_request(TokenizedGenerateReqInput(rid=rid, input_ids=ids, mm_items=items, sampling_params={
            "max_new_tokens": NEW_TOKENS, "temperature": 0.0}))
        results[rid] = [[], 0, reference(setup, prompt, media)]
    scheduler.run_until_idle()
    for out in scheduler.take_outputs():
        for i, rid in enumerate(out.rids):
            results[rid][0] += out.new_token_ids[i]
            results[rid][1] = out.cached_tokens[i]
    check_no_leak(scheduler)
    return {rid: tuple(r) for rid, r in results.items()}


def test_greedy_matches_transformers(setup: Any) -> None:
    results = run(setup, {  # all four in one batch
        "one image": ["Describe ", ("image", png(1, 24, 32)), " briefly."],
        "two images": [("image", png(2, 16, 16)), " and ", ("image", png(3, 40, 24)), " differ how?"],
        "video": ["Watch ", ("video", [png(4, 16, 24), png(5, 16, 24), png(6, 16, 24)]), " then tell."],
        "text only": ["No picture here."],
    })
    for rid, (got, _, want) in results.items():
        assert got == want, rid


def test_the_same_image_reuses_the_cached_prefix(setup: Any) -> None:
    processor = setup[1]
    url = png(7, 24, 24)
    (item,) = processor.process(*chat(processor, [("image", url), "Is it red?"]), False, "messages")[1]
    first = run(setup, {"first": [("image", url), "Is it red?"]})["first"]
    again = run(setup, {"again": [("image", url), "Is it blue?"]})["again"]
    other = run(setup, {"other": [("image", png(8, 24, 24)), "Is it red?"]})["other"]
    assert first[1] <= item.offset and again[1] >= item.end  # the image's KV is reused
    assert other[1] <= item.offset  # a different image shares only the text before it
    for got, _, want in (first, again, other):
        assert got == want


def test_decoder_logits_with_three_section_positions(setup: Any) -> None:
    """Text through the decoder at arbitrary (temporal, height, width) positions: the last
    position's logits agree with transformers' text forward given the same position ids."""
    from engine.model_executor.forward_batch import ForwardBatch, ForwardMode

    scheduler, _, hf = setup
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
        ours = runner.forward(batch).next_token_logits[0].float()
    finally:
        runner.token_to_kv_pool_allocator.free(loc)
        runner.req_to_token_pool.free(slots)
    with torch.no_grad():
        want = hf(torch.tensor([ids]), position_ids=positions[:, None, :]).logits[0, -1]
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
