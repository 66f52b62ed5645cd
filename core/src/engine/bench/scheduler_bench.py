"""``engine bench scheduler``: the scheduler's own CPU cost, with a null model.

The model forward is replaced by a constant-logits stub, so each decode step's
time is the scheduler's bookkeeping: batch preparation, KV allocation, sampling
info, result processing and output emission. Also measures radix-cache
prefix-match and insert throughput on a shared-prefix tree.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from typing import Any

import torch

from engine.bench.results import append_rows


class _NullForward:
    """Stands in for ModelRunner.forward: constant logits over 8 tokens, no compute.

    A narrow vocabulary keeps the argmax (device work on a real GPU) out of the
    measured CPU overhead.
    """

    def __call__(self, fb: Any) -> Any:
        from engine.layers.logits_processor import LogitsProcessorOutput

        logits = torch.zeros(fb.batch_size, 8)
        logits[:, 7] = 1.0
        return LogitsProcessorOutput(next_token_logits=logits)


def _make_scheduler(max_tokens: int, max_running: int) -> Any:
    from engine.testing.checkpoints import make_tiny_checkpoint
    from engine.testing.harness import make_scheduler

    path = make_tiny_checkpoint(tempfile.mkdtemp(prefix="bench-sched-"), "LlamaForCausalLM",
                                num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                max_position_embeddings=4096)
    sched = make_scheduler(path, max_total_tokens=max_tokens, max_running_requests=max_running,
                           context_length=4096)
    sched.runner.forward = _NullForward()  # type: ignore[method-assign]
    return sched


def decode_step_overhead(running: int, steps: int = 50, prompt_len: int = 128, stream: bool = False) -> dict[str, Any]:
    from engine.testing.harness import submit

    sched = _make_scheduler(running * (prompt_len + steps + 16) + 1024, running)
    rng = random.Random(0)
    for _ in range(running):
        submit(sched, [rng.randrange(8, 2000) for _ in range(prompt_len)],
               {"max_new_tokens": steps + 10, "temperature": 0, "ignore_eos": True}, stream=stream)
    while sched.waiting_queue or sched.chunked_req:
        sched.step()
        sched.take_outputs()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        sched.step()
        sched.take_outputs()
        times.append(time.perf_counter() - t)
    assert len(sched.running_batch.reqs) == running
    return {"running_requests": running, "stream": stream, "median_step_ms": statistics.median(times) * 1e3,
            "p90_step_ms": sorted(times)[int(0.9 * len(times))] * 1e3}


def radix_throughput(groups: int = 64, per_group: int = 16, system_len: int = 1024, question_len: int = 128) -> dict[str, float]:
    from engine.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
    from engine.mem_cache.radix_cache import RadixCache

    total = groups * (system_len + per_group * question_len) + 1024
    alloc = TokenToKVPoolAllocator(total, 1, "cpu")
    cache = RadixCache(ReqToTokenPool(4, 8, "cpu"), alloc, 1)
    rng = random.Random(0)
    systems = [[rng.randrange(50000) for _ in range(system_len)] for _ in range(groups)]
    keys = [s + [rng.randrange(50000) for _ in range(question_len)] for s in systems for _ in range(per_group)]
    rng.shuffle(keys)
    t = time.perf_counter()
    for key in keys:
        match = cache.match_prefix(key)
        rest = len(key) - len(match.device_indices)
        value = torch.cat([match.device_indices, alloc.alloc(rest)]) if rest else match.device_indices
        cache.insert(key, value)
    insert_s = time.perf_counter() - t
    t = time.perf_counter()
    for key in keys:
        cache.match_prefix(key)
    match_s = time.perf_counter() - t
    n = len(keys)
    return {"requests": n, "tokens_per_request": system_len + question_len,
            "match_insert_per_s": n / insert_s, "match_per_s": n / match_s,
            "match_us": match_s / n * 1e6, "match_insert_us": insert_s / n * 1e6}


def bench_scheduler(sizes: list[int], result_file: str | None = None) -> list[dict[str, Any]]:
    torch.set_num_threads(1)  # one CPU core, as the goal states
    rows: list[dict[str, Any]] = []
    for stream in (False, True):
        for n in sizes:
            row = {"bench": "scheduler-decode-step", **decode_step_overhead(n, stream=stream)}
            print(f"{n:>5} running requests{' (streaming every token)' if stream else ''}: median decode step "
                  f"{row['median_step_ms']:.3f} ms (p90 {row['p90_step_ms']:.3f} ms)", flush=True)
            rows.append(row)
    radix = {"bench": "radix-cache", **radix_throughput()}
    print(f"radix cache ({radix['requests']} requests of {radix['tokens_per_request']} tokens, 64 shared prefixes): "
          f"match {radix['match_us']:.1f} us, match+insert {radix['match_insert_us']:.1f} us", flush=True)
    rows.append(radix)
    append_rows(result_file, *rows)
    return rows
