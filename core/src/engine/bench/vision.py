"""``engine bench vision``: the vision encoder's share of an image prompt's prefill.

In one process (like ``one-batch``): the model's own processor turns a chat prompt with
``image_count`` random images and a short text into ids and items, then three timings, each the
median of ``reps`` runs after a warm-up:

- the encoder alone: ``embed_multimodal`` over the prompt's images (vision tower and merger);
- the prefill of the prompt with its images (the embedding cache emptied before each run, so the
  encoder runs every time), as the scheduler runs it;
- the prefill of a text-only prompt of the same token count.

The share is the encoder's time over the image prefill's.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from engine.bench.results import append_rows
from engine.config import ServerArgs
from engine.platforms import synchronize_device


def _prompt(processor: Any, image_count: int, resolution: str, text_words: int) -> tuple[list[int], list[Any]]:
    from PIL import Image

    from engine.bench.images import parse_resolution
    from engine.multimodal.media import MediaRef

    width, height = parse_resolution(resolution)
    gen = torch.Generator().manual_seed(0)
    images = [Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8).numpy())
              for _ in range(image_count)]
    text = " ".join(["describe"] * text_words)
    conversation = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}]
    prompt = processor.render_chat(conversation, True, {}, processor.tokenizer)
    media = [MediaRef("image", img, f"image[{i}]") for i, img in enumerate(images)]
    return processor.process(prompt, media, add_special_tokens=False, where="bench")


def _prefill_s(scheduler: Any, ids: list[int], items: list[Any], rid: str) -> float:
    """One prefill of ``ids`` (with ``items``) on an empty KV pool; the KV is freed after."""
    from engine.managers.schedule_batch import Req, ScheduleBatch
    from engine.sampling.sampling_batch_info import SamplingBatchInfo
    from engine.sampling.sampling_params import SamplingParams

    runner = scheduler.runner
    req = Req(rid, list(ids), SamplingParams(max_new_tokens=1, temperature=0), set())
    req.fill_ids, req.extend_input_len = list(ids), len(ids)
    error = scheduler._attach_multimodal(req, items)
    if error:
        raise ValueError(error)
    runner.mm_cache.clear()
    batch = ScheduleBatch([req], runner.req_to_token_pool, runner.token_to_kv_pool_allocator,
                          scheduler.tree_cache, runner.device)
    synchronize_device(runner.device)
    start = time.perf_counter()
    fb = batch.prepare_for_extend()
    fb.sampling_info = SamplingBatchInfo.from_reqs([req], runner.vocab_size, runner.device)
    runner.sample(runner.forward(fb), fb).next_token_ids.tolist()
    elapsed = time.perf_counter() - start
    slots = runner.req_to_token_pool.req_to_token[req.req_pool_idx, : len(ids)].long()
    runner.token_to_kv_pool_allocator.free(slots)
    runner.req_to_token_pool.free(req.req_pool_idx)
    runner.mm_cache.release(rid)
    return elapsed


def bench_vision(args: ServerArgs, image_count: int, resolution: str, text_words: int, reps: int,
                 result_file: str | None = None) -> dict[str, Any]:
    from engine.entrypoints.launch import resolve_model_path
    from engine.managers.scheduler import Scheduler
    from engine.multimodal.media import MediaLimits
    from engine.multimodal.processor import MultimodalProcessor

    model_path = resolve_model_path(args)
    scheduler = Scheduler(args, model_path)
    runner = scheduler.runner
    if not runner.multimodal:
        raise ValueError(f"--model-path {args.model_path}: {runner.hf_config.architectures[0]} takes no images; "
                         "accepted: a vision-language model")
    processor = MultimodalProcessor(model_path, runner.vocab_size, max(16, image_count), MediaLimits(),
                                    args.trust_remote_code)
    ids, items = _prompt(processor, image_count, resolution, text_words)
    text_ids = torch.randint(0, min(runner.vocab_size, 32000), (len(ids),),
                             generator=torch.Generator().manual_seed(1)).tolist()

    def encoder_s() -> float:
        synchronize_device(runner.device)
        start = time.perf_counter()
        with torch.inference_mode():
            runner.model.embed_multimodal(items)
        synchronize_device(runner.device)
        return time.perf_counter() - start

    timings: dict[str, list[float]] = {"encoder": [], "image_prefill": [], "text_prefill": []}
    for rep in range(reps + 1):  # the first round compiles and captures: not counted
        for key, run in (("encoder", encoder_s), ("image_prefill", lambda: _prefill_s(scheduler, ids, items, "v")),
                         ("text_prefill", lambda: _prefill_s(scheduler, text_ids, [], "t"))):
            value = run()
            if rep:
                timings[key].append(value)
    med = {k: statistics.median(v) for k, v in timings.items()}
    result = {
        "bench": "vision", "device": runner.platform.describe(), "model_path": args.model_path,
        "image_count": image_count, "image_resolution": resolution, "prompt_tokens": len(ids),
        "image_tokens": sum(it.length for it in items), "reps": reps,
        "encoder_ms": med["encoder"] * 1e3, "image_prefill_ms": med["image_prefill"] * 1e3,
        "text_prefill_ms": med["text_prefill"] * 1e3,
        "encoder_share": med["encoder"] / med["image_prefill"],
    }
    print(f"{image_count} image(s) of {resolution}: {result['image_tokens']} image tokens of {len(ids)} prompt tokens; "
          f"encoder {result['encoder_ms']:.2f} ms, prefill with images {result['image_prefill_ms']:.2f} ms "
          f"(encoder share {result['encoder_share']:.2f}), text-only prefill of {len(ids)} tokens "
          f"{result['text_prefill_ms']:.2f} ms", flush=True)
    append_rows(result_file, result)
    return result
