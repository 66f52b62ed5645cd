"""The tiny LLaVA on an in-process scheduler against transformers' ``generate`` in float32: one and
two images, a batch mixing text-only and image requests, an image cut by chunked prefill, the
prefix cache keyed by image, and the item-embedding cache freed on abort."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.config import ServerArgs
from engine.managers.io_struct import TokenizedGenerateReqInput
from engine.managers.scheduler import Scheduler, check_no_leak
from engine.multimodal.media import MediaLimits, MediaRef, load_image
from engine.multimodal.processor import MultimodalProcessor

from .conftest import IMAGE_TOKENS, png_data_url

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def setup(llava_ckpt: str) -> Any:
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    args = ServerArgs.from_dict({"model_path": llava_ckpt, "max_total_tokens": 2048, "disable_overlap_schedule": True})
    scheduler = Scheduler(args, llava_ckpt)
    processor = MultimodalProcessor(llava_ckpt, scheduler.runner.vocab_size, 4, MediaLimits())
    tokenizer = AutoTokenizer.from_pretrained(llava_ckpt)
    hf = LlavaForConditionalGeneration.from_pretrained(llava_ckpt, dtype=torch.float32).eval()
    return scheduler, processor, tokenizer, hf


def _prompt(setup: Any, text: str, images: int) -> str:
    _, processor, tokenizer, _ = setup
    parts = [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": text}]
    return processor.render_chat([{"role": "user", "content": parts}], True, {}, tokenizer)


def _request(setup: Any, rid: str, text: str, seeds: list[int]) -> TokenizedGenerateReqInput:
    _, processor, _, _ = setup
    media = [MediaRef("image", png_data_url(s), f"image {s}") for s in seeds]
    ids, items = processor.process(_prompt(setup, text, len(seeds)), media, False, "messages")
    return TokenizedGenerateReqInput(rid=rid, input_ids=ids, mm_items=items,
                                     sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0.0})


def _reference(setup: Any, text: str, seeds: list[int]) -> list[int]:
    _, processor, _, hf = setup
    images = [load_image(png_data_url(s), "x", MediaLimits()) for s in seeds]
    inputs = processor.processor(text=[_prompt(setup, text, len(seeds))], images=images or None, return_tensors="pt",
                                 add_special_tokens=False)
    out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _run(scheduler: Scheduler, reqs: list[TokenizedGenerateReqInput]) -> dict[str, tuple[list[int], int]]:
    for req in reqs:
        scheduler.add_request(req)
    scheduler.run_until_idle()
    got: dict[str, list[int]] = {r.rid: [] for r in reqs}
    cached: dict[str, int] = {}
    for out in scheduler.take_outputs():
        for i, rid in enumerate(out.rids):
            got[rid] += out.new_token_ids[i]
            cached[rid] = out.cached_tokens[i]
            assert out.finished_reasons[i] is None or out.finished_reasons[i]["type"] == "length", out.finished_reasons[i]
    check_no_leak(scheduler)
    return {rid: (ids, cached[rid]) for rid, ids in got.items()}


def test_one_and_two_images_match_transformers(setup: Any) -> None:
    scheduler = setup[0]
    one = _request(setup, "one", "What is in the picture?", [1])
    two = _request(setup, "two", "Compare these two.", [2, 3])
    assert [it.length for it in one.mm_items] == [IMAGE_TOKENS] and one.mm_items[0].offset > 0
    assert len(two.mm_items) == 2 and two.mm_items[0].hash != two.mm_items[1].hash
    out = _run(scheduler, [one])
    assert out["one"][0] == _reference(setup, "What is in the picture?", [1])
    out = _run(scheduler, [two])
    assert out["two"][0] == _reference(setup, "Compare these two.", [2, 3])


def test_mixed_text_and_image_requests_in_one_batch(setup: Any) -> None:
    scheduler = setup[0]
    text_only = _request(setup, "text", "Tell me a story.", [])
    image = _request(setup, "image", "Describe it.", [4])
    assert not text_only.mm_items
    before = scheduler.forward_steps
    out = _run(scheduler, [text_only, image])
    # Both prompts prefill in one forward, then decode together.
    assert scheduler.forward_steps - before == NEW_TOKENS
    assert out["text"][0] == _reference(setup, "Tell me a story.", [])
    assert out["image"][0] == _reference(setup, "Describe it.", [4])


def test_prefix_cache_is_keyed_by_the_image(setup: Any) -> None:
    scheduler = setup[0]
    cache = scheduler.runner.mm_cache
    _run(scheduler, [_request(setup, "first", "Is it red?", [5])])
    computed = cache.computed
    same = _request(setup, "same", "Is it blue?", [5])
    other = _request(setup, "other", "Is it red?", [6])
    item = same.mm_items[0]
    out = _run(scheduler, [same])
    assert out["same"][1] >= item.end  # the image's KV came from the cache
    out = _run(scheduler, [other])
    assert out["other"][1] <= item.offset  # a different image shares only the text before it
    assert out["other"][0] == _reference(setup, "Is it red?", [6])
    assert cache.computed == computed + 1  # only the new image ran through the tower
    stats = scheduler.stats()
    assert (stats["mm_items_embedded"], stats["mm_embedding_cache_hits"]) == (cache.computed, cache.hits)
    assert 0 < stats["mm_embedding_cache_bytes"] <= 256 << 20
    assert scheduler.flush_cache() and len(cache) == 0 and scheduler.stats()["mm_embedding_cache_bytes"] == 0


def test_chunked_prefill_cutting_an_image_matches(setup: Any) -> None:
    scheduler = setup[0]
    scheduler.runner.mm_cache.clear()
    old = scheduler.args.chunked_prefill_size
    scheduler.args.chunked_prefill_size = 5  # the 9-token image run spans three chunks
    try:
        req = _request(setup, "chunked", "Chunk me, please.", [7, 8])
        out = _run(scheduler, [req])
        assert out["chunked"][0] == _reference(setup, "Chunk me, please.", [7, 8])
        assert not scheduler.runner.mm_cache.pinned()
        # Aborted in the middle of its prefill: its pins go with it.
        scheduler.runner.mm_cache.clear()
        scheduler.add_request(_request(setup, "aborted", "Never finished.", [9]))
        scheduler.step()
        scheduler.step()
        assert scheduler.runner.mm_cache.pinned()
        scheduler.abort_request("aborted")
        scheduler.run_until_idle()
        scheduler.take_outputs()
        assert not scheduler.runner.mm_cache.pinned()
        check_no_leak(scheduler)
    finally:
        scheduler.args.chunked_prefill_size = old


def test_an_image_on_a_text_only_model_is_refused(llama_ckpt: str, setup: Any) -> None:
    args = ServerArgs.from_dict({"model_path": llama_ckpt, "max_total_tokens": 256})
    from engine.managers.scheduler import Scheduler as S

    scheduler = S(args, llama_ckpt)
    req = _request(setup, "refused", "hi", [1])
    req.input_ids = [t % 2048 for t in req.input_ids]
    scheduler.add_request(req)
    (out,) = scheduler.take_outputs()
    assert out.finished_reasons[0]["type"] == "abort" and "takes no images" in out.finished_reasons[0]["message"]


def test_a_retracted_image_request_resumes_with_the_same_output(setup: Any) -> None:
    scheduler = setup[0]
    scheduler.add_request(_request(setup, "retracted", "Once more.", [10]))
    for _ in range(3):  # the prefill and two decode steps
        scheduler.step()
    (req,) = [r for r in scheduler.running_batch.reqs if r.rid == "retracted"]
    assert len(req.output_ids) == 3
    scheduler._retract([req])
    scheduler.running_batch.filter([r for r in scheduler.running_batch.reqs if r is not req])
    # Nothing cached: the re-prefill runs the image (and the output so far) through the model again.
    scheduler.tree_cache.evict(scheduler.runner.max_total_num_tokens)
    scheduler.runner.mm_cache.clear()
    computed = scheduler.runner.mm_cache.computed
    scheduler.run_until_idle()
    scheduler.take_outputs()
    check_no_leak(scheduler)
    assert scheduler.runner.mm_cache.computed == computed + 1
    assert req.output_ids == _reference(setup, "Once more.", [10]) and req.retractions == 1
