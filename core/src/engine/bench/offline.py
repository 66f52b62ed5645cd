"""``engine bench offline``: the whole Engine (three processes) on a dataset, all at once."""

from __future__ import annotations

import time
from typing import Any

from engine.bench.datasets import DatasetArgs, sample_requests
from engine.bench.results import append_rows
from engine.bench.server_stats import (
    SAMPLE_INTERVAL_S,
    print_breakdown,
    run_breakdown,
    sample_point,
)
from engine.config import ServerArgs


async def _run_with_progress(engine: Any, prompts: list[list[int]], params: list[dict[str, Any]],
                             progress: bool, loras: list[str | None],
                             samples: list[dict[str, float]] | None = None) -> list[dict[str, Any]]:
    """Runs every request at once; prints a progress line at each tenth of completions. With
    ``samples``, a task appends the scheduler's counters to it every ``SAMPLE_INTERVAL_S``."""
    import asyncio
    import sys

    from engine.managers.tokenizer_manager import GenerateRequest

    manager = engine.tokenizer_manager

    async def sample(start: float) -> None:
        while True:
            await asyncio.sleep(SAMPLE_INTERVAL_S)
            reply = await manager.control("server_info")
            samples.append(sample_point(time.perf_counter() - start, reply.data or {}))

    async def one(i: int) -> tuple[int, dict[str, Any]]:
        out: dict[str, Any] = {}
        async for out in manager.generate(GenerateRequest(input_ids=prompts[i], sampling_params=params[i],
                                                                  lora_path=loras[i])):
            pass
        return i, out

    results: list[dict[str, Any]] = [{}] * len(prompts)
    step = max(1, len(prompts) // 10)
    start = time.perf_counter()
    sampler = asyncio.ensure_future(sample(start)) if samples is not None else None
    try:
        for done, fut in enumerate(asyncio.as_completed([one(i) for i in range(len(prompts))]), start=1):
            i, out = await fut
            results[i] = out
            if progress and (done % step == 0 or done == len(prompts)):
                print(f"  {done}/{len(prompts)} requests done, {time.perf_counter() - start:.1f} s", file=sys.stderr,
                      flush=True)
    finally:
        if sampler is not None:
            sampler.cancel()
            try:
                await sampler
            except (asyncio.CancelledError, Exception):  # noqa: BLE001  (a reply lost to the cancel)
                pass
    return results


def bench_offline(args: ServerArgs, data: DatasetArgs, result_file: str | None = None,
                  progress: bool = True, lora_names: list[str] | None = None) -> dict[str, Any]:
    """Runs the dataset; with ``lora_names`` request ``i`` runs on ``lora_names[i % len]``."""
    from engine.entrypoints.engine import Engine

    with Engine(**args.to_dict()) as engine:
        tokenizer = None if args.skip_tokenizer_init else engine.tokenizer
        if tokenizer is None and data.vocab_size is None:
            data.vocab_size = engine.runtime.ready.vocab_size
        requests = sample_requests(data, tokenizer, return_text=False)
        prompts = [r.prompt if isinstance(r.prompt, list) else tokenizer.encode(r.prompt) for r in requests]
        params = [{"max_new_tokens": r.output_len, "temperature": 0, "ignore_eos": True} for r in requests]
        # Warm-up: one small request compiles kernels and fills caches outside the timed run.
        engine.generate(input_ids=prompts[0][:16], sampling_params={"max_new_tokens": 4})
        engine.flush_cache()
        if progress:
            print(f"running {len(prompts)} requests...", flush=True)
        before = engine.get_server_info()
        start = time.perf_counter()
        loras = [lora_names[i % len(lora_names)] if lora_names else None for i in range(len(prompts))]
        samples: list[dict[str, float]] = []
        outs = engine.loop.run_until_complete(_run_with_progress(engine, prompts, params, progress, loras, samples))
        duration = time.perf_counter() - start
        info = engine.get_server_info()
    out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    result = {
        "bench": "offline", "dataset": data.dataset_name, "num_prompts": len(prompts), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens, "cached_tokens": cached,
        "request_throughput": len(prompts) / duration, "input_throughput": in_tokens / duration,
        "output_throughput": out_tokens / duration, "total_throughput": (in_tokens + out_tokens) / duration,
        "attention": info["attention_backend"], "device": info.get("device_description") or info["device"], "platform": info["platform"],
        "disable_radix_cache": args.disable_radix_cache, "model_path": args.model_path, "quant": args.quant,
        "tp_size": args.tp_size,
        **(_lora_fields(args, lora_names, len(prompts)) if lora_names else {}),
        **run_breakdown(before, samples, info, duration),
    }
    if args.dp_size > 1:  # which replica got what, and why (cache_hit, least_loaded, round_robin, ...)
        result.update(dp_size=args.dp_size, router_policy=args.router_policy,
                      router_decisions=[_decisions_diff(b, a) for b, a in
                                        zip(before["router"]["replicas"], info["router"]["replicas"])])
    print("============ Offline Throughput Benchmark Result ============")
    for key in ("num_prompts", "duration_s", "total_input_tokens", "total_output_tokens", "cached_tokens",
                "request_throughput", "input_throughput", "output_throughput", "total_throughput"):
        value = result[key]
        print(f"{key:<28}{value:>14.2f}" if isinstance(value, float) else f"{key:<28}{value:>14}")
    print_breakdown(result)
    if args.dp_size > 1:
        print(f"{'router':<28}{args.router_policy:>14}  decisions per replica: {result['router_decisions']}")
    append_rows(result_file, result)
    return result


def _lora_fields(args: ServerArgs, names: list[str], num_prompts: int) -> dict[str, Any]:
    """A LoRA run's row fields: the distinct adapters the prompts ran and their largest rank."""
    from engine.bench.one_batch import lora_rows
    from engine.lora.adapter import startup_lora_shape

    used = lora_rows(names, num_prompts)
    rank, _ = startup_lora_shape({n: args.lora_paths[n] for n in used})
    return {"lora_adapters": len(used), "lora_rank": rank}


def _decisions_diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """A replica's routing decisions by reason over the timed run."""
    counts = {k: v - before["decisions"].get(k, 0) for k, v in after["decisions"].items()}
    return {k: v for k, v in counts.items() if v}
