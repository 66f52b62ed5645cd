"""``engine bench offline``: the whole Engine (three processes) on a dataset, all at once."""

from __future__ import annotations

import time
from typing import Any

from engine.bench.datasets import DatasetArgs, sample_requests
from engine.bench.results import append_rows
from engine.config import ServerArgs

#: Seconds between the scheduler samples the timed run takes (running and waiting requests, counters).
SAMPLE_INTERVAL_S = 0.5
#: Decode batch-size bands the run's decode time is split into (lower bounds).
BATCH_BANDS = (1, 64, 256, 512, 768, 1024)
_SAMPLED = ("num_running_reqs", "num_waiting_reqs", "kv_usage", "decode_steps", "decode_rows", "decode_time_s",
            "graph_decode_steps", "extend_tokens", "extend_time_s")


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
            samples.append(_sample_point(time.perf_counter() - start, reply.data or {}))

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
        **_step_breakdown(before, info, duration),
        **_timeline(before, samples, info, duration),
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
    print(f"{'decode steps':<28}{result['decode_steps']:>14}  (mean batch {result['mean_decode_batch']:.1f}, "
          f"{result['mean_decode_step_ms']:.2f} ms, {result['overlapped_decode_steps']} overlapped)")
    print(f"{'prefill tokens computed':<28}{result['extend_tokens']:>14}  ({result['retractions']} retractions)")
    print(f"{'prefill share of time':<28}{result['prefill_time_share']:>14.2f}  "
          f"(prefill {result['extend_time_s']:.1f} s, decode {result['decode_time_s']:.1f} s)")
    _print_timeline(result)
    if args.dp_size > 1:
        print(f"{'router':<28}{args.router_policy:>14}  decisions per replica: {result['router_decisions']}")
    append_rows(result_file, result)
    return result


def _lora_fields(args: ServerArgs, names: list[str], num_prompts: int) -> dict[str, Any]:
    """A LoRA run's row fields: the adapters used and their largest rank."""
    from engine.lora.adapter import startup_lora_shape

    rank, _ = startup_lora_shape({n: args.lora_paths[n] for n in names})
    return {"lora_adapters": min(len(names), num_prompts), "lora_rank": rank}


def _decisions_diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """A replica's routing decisions by reason over the timed run."""
    counts = {k: v - before["decisions"].get(k, 0) for k, v in after["decisions"].items()}
    return {k: v for k, v in counts.items() if v}


def _step_breakdown(before: dict[str, Any], after: dict[str, Any], duration: float) -> dict[str, Any]:
    """Where the timed run went, from the scheduler's counters (differences over the run)."""
    def diff(key: str) -> Any:
        return after.get(key, 0) - before.get(key, 0)

    steps = diff("decode_steps")
    return {
        "retractions": diff("num_retractions"), "decode_steps": steps,
        "overlapped_decode_steps": diff("overlapped_decode_steps"),
        "mean_decode_batch": diff("decode_rows") / steps if steps else 0.0,
        "mean_decode_step_ms": 1e3 * diff("decode_time_s") / steps if steps else 0.0,
        "extend_tokens": diff("extend_tokens"),
        "extend_time_s": diff("extend_time_s"), "decode_time_s": diff("decode_time_s"),
        "prefill_time_share": diff("extend_time_s") / duration if duration > 0 else 0.0,
        "graph_decode_steps": diff("graph_decode_steps"),
    }


def _sample_point(t: float, info: dict[str, Any]) -> dict[str, float]:
    """One point of the run's timeline: ``t`` (s) and the scheduler's ``_SAMPLED`` counters."""
    return {"t": t, **{k: float(info.get(k, 0) or 0) for k in _SAMPLED}}


def _timeline(before: dict[str, Any], samples: list[dict[str, float]], after: dict[str, Any],
              duration: float) -> dict[str, Any]:
    """What the samples of the timed run show: decode time by batch-size band (each interval
    between two samples counts in the band of its mean batch), when the last request was admitted
    (no request waiting), the most requests running at once, and a coarse timeline."""
    points = [_sample_point(0.0, before), *samples,
              _sample_point(max(duration, samples[-1]["t"] if samples else 0.0), after)]
    bands: dict[int, list[float]] = {b: [0.0, 0.0, 0.0] for b in BATCH_BANDS}  # steps, rows, seconds
    for a, b in zip(points, points[1:], strict=False):
        steps = b["decode_steps"] - a["decode_steps"]
        if steps > 0:
            rows = b["decode_rows"] - a["decode_rows"]
            band = max(x for x in BATCH_BANDS if x <= max(1.0, rows / steps))
            bands[band][0] += steps
            bands[band][1] += rows
            bands[band][2] += b["decode_time_s"] - a["decode_time_s"]
    # The first sample with nothing waiting after prefill began (before it, the requests may not have arrived).
    admitted = next((p["t"] for p in samples if p["num_waiting_reqs"] == 0
                     and p["extend_tokens"] > points[0]["extend_tokens"]), None)
    # About 16 rows of (time, running, waiting, KV use, decode steps/s, mean batch) over the run.
    stride = max(1, (len(points) - 1) // 16)
    coarse = []
    for a, b in zip(points[::stride], points[stride::stride], strict=False):
        dt, steps = b["t"] - a["t"], b["decode_steps"] - a["decode_steps"]
        coarse.append([round(b["t"], 2), int(b["num_running_reqs"]), int(b["num_waiting_reqs"]),
                       round(b["kv_usage"], 3), round(steps / dt, 1) if dt > 0 else 0.0,
                       round((b["decode_rows"] - a["decode_rows"]) / steps, 1) if steps else 0.0,
                       round((b["extend_tokens"] - a["extend_tokens"]) / dt) if dt > 0 else 0])
    return {
        "decode_by_batch": [{"batch_from": band, "steps": int(v[0]), "rows": int(v[1]), "time_s": round(v[2], 3)}
                            for band, v in bands.items() if v[0]],
        "all_admitted_s": admitted,
        "max_running": int(max((p["num_running_reqs"] for p in samples), default=0)),
        "cuda_graph_max_bs": max(after.get("cuda_graph_batch_sizes") or [0]),
        "timeline": coarse,
    }


def _print_timeline(result: dict[str, Any]) -> None:
    """The sampled part of the result, as lines under the summary."""
    graphs, max_bs = result["graph_decode_steps"], result["cuda_graph_max_bs"]
    print(f"{'decode steps from graphs':<28}{graphs:>14}  ("
          + (f"graphs up to batch {max_bs}; " if max_bs else "no graphs; ")
          + f"{result['decode_steps'] - graphs} eager or speculative)")
    admitted = result["all_admitted_s"]
    print(f"{'most running at once':<28}{result['max_running']:>14}  (last request admitted at "
          + (f"{admitted:.1f} s)" if admitted is not None else "the end)"))
    print("decode time by batch size:")
    for band in result["decode_by_batch"]:
        steps = band["steps"]
        print(f"  batch >= {band['batch_from']:<5} {steps:>7} steps  {band['time_s']:8.2f} s  "
              f"mean batch {band['rows'] / steps:7.1f}  {1e3 * band['time_s'] / steps:7.2f} ms/step")
    print("timeline:   t (s)  running  waiting  KV use  decode steps/s  mean batch  prefill tok/s")
    for t, running, waiting, kv, rate, batch, prefill in result["timeline"]:
        print(f"  {t:>12.1f} {running:>8} {waiting:>8} {kv:>7.2f} {rate:>15.1f} {batch:>11.1f} {prefill:>14}")
