"""``engine bench serving``: drive a running server over HTTP and report serving metrics.

Field and flag names mirror SGLang's ``bench_serving`` so existing command lines carry over.
Requests arrive as a seeded Poisson process (``request_rate``) and at most
``max_concurrency`` run at once; failed requests are recorded, never fatal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import math
import sys
import time
from typing import Any

import httpx
import numpy as np

from engine.bench.backends import BACKENDS, auth_headers, send_request
from engine.bench.datasets import BenchRequest, TokenizerLike, sample_requests
from engine.bench.metrics import (
    BenchMetrics,
    RequestResult,
    compute_metrics,
    format_report,
    to_json_line,
)
from engine.bench.results import run_command
from engine.bench.server_stats import (
    SAMPLE_INTERVAL_S,
    has_counters,
    print_breakdown,
    run_breakdown,
    sample_point,
)
from engine.bench.serving_args import BenchServingArgs
from engine.bench.serving_clients import (
    make_client,
    request_options,
    send_in_processes,
    send_on_schedule,
)

__all__ = [
    "BenchServingArgs",
    "arrival_offsets",
    "benchmark_serving",
    "build_requests",
    "load_tokenizer",
    "resolve_model",
    "run_benchmark",
    "run_requests",
    "server_info",
]

# Warmup only has to touch every code path (compile, CUDA graphs), not run long.
WARMUP_MAX_OUTPUT_LEN = 32


def benchmark_serving(
    args: BenchServingArgs, tokenizer: TokenizerLike | None = None
) -> BenchMetrics:
    """Resolve model and tokenizer, build the dataset, run it and return the metrics.

    Args:
        args: benchmark settings.
        tokenizer: an already loaded tokenizer; otherwise one is loaded from ``args.tokenizer``
            or the model name unless ``args.skip_tokenizer_init``.
    """
    return asyncio.run(_benchmark_serving(args, tokenizer))


async def _benchmark_serving(
    args: BenchServingArgs, tokenizer: TokenizerLike | None
) -> BenchMetrics:
    args = await resolve_model(args)
    if tokenizer is None and not args.skip_tokenizer_init:
        name = args.tokenizer or args.model
        if name is None:
            raise ValueError("no tokenizer: pass --tokenizer, --model, or --skip-tokenizer-init")
        tokenizer = load_tokenizer(name)
    if tokenizer is None and args.vocab_size is None:
        # Token-id prompts without a tokenizer draw from the served model's vocabulary.
        async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
            info = await server_info(client, args.server_url(), auth_headers(args.api_key))
        if info is not None and isinstance(info.get("vocab_size"), int):
            args = dataclasses.replace(args, vocab_size=info["vocab_size"])
    return await run_benchmark(args, build_requests(args, tokenizer), tokenizer)


def load_tokenizer(name_or_path: str) -> TokenizerLike:
    """Load a Hugging Face tokenizer; transformers is imported only here."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except Exception as exc:
        raise ValueError(
            f"cannot load tokenizer {name_or_path!r} ({exc}); pass --tokenizer with a local "
            "path, or --skip-tokenizer-init with --vocab-size"
        ) from exc


def build_requests(args: BenchServingArgs, tokenizer: TokenizerLike | None) -> list[BenchRequest]:
    """The dataset ``args`` names, as text when a tokenizer is loaded and ids otherwise."""
    if args.dataset_name == "image":
        from engine.bench.images import sample_image_requests

        requests = sample_image_requests(
            args.num_prompts, args.image_count, args.image_resolution, args.image_format,
            args.random_input_len, args.random_output_len, args.random_range_ratio, args.seed, tokenizer,
        )
    else:
        return_text = tokenizer is not None and not args.tokenize_prompt
        if not return_text and not BACKENDS[args.backend].accepts_token_ids:
            raise ValueError(
                f"backend {args.backend!r} needs text prompts: pass --tokenizer and drop "
                "--tokenize-prompt / --skip-tokenizer-init"
            )
        requests = sample_requests(args, tokenizer, return_text)
    if args.lora_name:
        # Each request picks an adapter at random (seeded), as SGLang's bench_serving does.
        rng = np.random.default_rng(args.seed)
        for req, pick in zip(requests, rng.integers(0, len(args.lora_name), size=len(requests))):
            req.lora_name = args.lora_name[int(pick)]
    return requests


async def resolve_model(args: BenchServingArgs) -> BenchServingArgs:
    """``args`` with ``model`` filled from GET /v1/models when unset.

    Native backends do not need a model name, so for them a failed lookup leaves it None.
    """
    if args.model is not None:
        return args
    url = args.server_url() + "/v1/models"
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
            response = await client.get(url, headers=auth_headers(args.api_key))
            response.raise_for_status()
            models = response.json().get("data") or []
        model = models[0]["id"] if models else None
    except Exception as exc:  # noqa: BLE001 - reported below with the URL
        model, reason = None, f"{type(exc).__name__}: {exc}"
    else:
        reason = "the server lists no model"
    if model is None and BACKENDS[args.backend].needs_model:
        raise ValueError(f"cannot detect the model from {url} ({reason}); pass --model")
    return dataclasses.replace(args, model=model)


async def run_benchmark(
    args: BenchServingArgs, requests: list[BenchRequest], tokenizer: TokenizerLike | None = None
) -> BenchMetrics:
    """Warm up, send ``requests``, print the report and append the result line if asked.

    Raises only when every warmup request fails (a misconfigured run); failures during
    the measured run are counted in ``BenchMetrics.failed``.
    """
    if not requests:
        raise ValueError("no requests to send: the dataset produced none")
    args = await resolve_model(args)
    run: dict[str, Any] = {}
    results, duration = await run_requests(args, requests, tokenizer, run)
    metrics = compute_metrics(results, duration)
    settings = {
        "Backend": args.backend,
        "Traffic request rate": args.request_rate,
        "Max request concurrency": args.max_concurrency or "not set",
    }
    print(format_report(metrics, settings=settings))
    # A client process that used its whole core measured its own delays as well as the server's.
    cpu = run.pop("client_cpu_s_by_process")
    senders = f"{len(cpu) - 1} sending processes and the parent" if len(cpu) > 1 else "1 process"
    print(f"{'client CPU':<28}{sum(cpu):>14.1f}  s ({senders}; the busiest {100 * max(cpu) / duration:.0f}% of "
          "the run: near 100% means the client set the pace, --client-processes splits it)")
    if "decode_steps" in run:
        print(" Server (scheduler counters over the run) ".center(50, "-"))
        print_breakdown(run, duration)
    _print_errors(results)
    if args.result_file:
        extra = {**_result_extra(args, results), "client_cpu_s": sum(cpu), "client_processes": args.client_processes,
                 "client_busiest_cpu_share": max(cpu) / duration, **run}
        with open(args.result_file, "a", encoding="utf-8") as f:
            f.write(to_json_line(metrics, extra) + "\n")
    return metrics


async def run_requests(
    args: BenchServingArgs, requests: list[BenchRequest], tokenizer: TokenizerLike | None = None,
    run: dict[str, Any] | None = None,
) -> tuple[list[RequestResult], float]:
    """Warm up, then send ``requests`` on schedule (from ``args.client_processes`` processes).

    Args:
        run: when given, filled with ``client_cpu_s_by_process`` (each sending process's CPU
            seconds over the measured part) and, when the server reports its scheduler's counters
            (GET /get_server_info, as this engine's servers do; ``--disable-server-stats`` skips
            it), where the run's time went on the server (``server_stats.run_breakdown``).

    Returns:
        Per-request results in ``requests`` order, and the seconds the measured part took.
    """
    if args.model is None and BACKENDS[args.backend].needs_model:
        args = await resolve_model(args)
    opts = request_options(args)
    backend = BACKENDS[args.backend]
    base_url = args.server_url()
    async with make_client(args) as client:
        if args.warmup_requests > 0:
            first = requests[0]
            warm = dataclasses.replace(first, output_len=min(first.output_len, WARMUP_MAX_OUTPUT_LEN))
            outputs = await asyncio.gather(*(send_request(client, base_url, backend, warm, opts, tokenizer)
                                             for _ in range(args.warmup_requests)))
            if not any(o.success for o in outputs):
                raise RuntimeError(
                    f"all {args.warmup_requests} warmup requests to {base_url}{backend.path} "
                    f"failed; check --backend, --host/--port. First error: {outputs[0].error}"
                )

        before = None
        if run is not None and not args.disable_server_stats:
            before = await server_info(client, base_url, opts.headers)
            before = before if before is not None and has_counters(before) else None
        samples: list[dict[str, float]] = []
        sampler: asyncio.Task[None] | None = None

        def sample_from(start: float) -> None:
            nonlocal sampler
            if before is not None:
                sampler = asyncio.create_task(_sample(client, base_url, opts.headers, start, samples))

        offsets = arrival_offsets(len(requests), args.request_rate, args.seed)
        progress = _ProgressPrinter(len(requests), enabled=not args.disable_tqdm)
        cpu = time.process_time()
        try:
            if args.client_processes > 1:
                results, start, end, cpus = await send_in_processes(
                    args, requests, offsets, args.client_processes, tokenizer, on_start=sample_from)
            else:
                start = time.perf_counter()
                sample_from(start)
                results = await send_on_schedule(client, args, requests, offsets, start, tokenizer, progress.update,
                                                 opts)
                end, cpus = time.perf_counter(), []
        finally:
            if sampler is not None:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
        duration = end - start
        if run is not None:
            run["client_cpu_s_by_process"] = [time.process_time() - cpu, *cpus]
        if before is not None:
            after = await server_info(client, base_url, opts.headers)
            if after is not None and has_counters(after):
                run.update(run_breakdown(before, samples, after, duration))  # type: ignore[union-attr]
                # The device as the server's platform names it: what the benchmarks page files the row under.
                run["device"] = after.get("device_description") or after.get("device")  # type: ignore[index]
    return results, duration


async def server_info(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> dict[str, Any] | None:
    """The server's GET /get_server_info reply; None where it has none (another engine) or fails."""
    try:
        response = await client.get(base_url + "/get_server_info", headers=headers, timeout=10.0)
        if response.status_code != 200:
            return None
        info = response.json()
    except (httpx.HTTPError, ValueError):
        return None
    return info if isinstance(info, dict) else None


async def _sample(client: httpx.AsyncClient, base_url: str, headers: dict[str, str], start: float,
                  samples: list[dict[str, float]]) -> None:
    """Appends the scheduler's counters to ``samples`` every ``SAMPLE_INTERVAL_S`` until cancelled."""
    while True:
        await asyncio.sleep(SAMPLE_INTERVAL_S)
        info = await server_info(client, base_url, headers)
        if info is not None and has_counters(info):
            samples.append(sample_point(time.perf_counter() - start, info))


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds after the start: a Poisson process of ``request_rate`` per second.

    Gaps are exponential with mean ``1 / request_rate``; the first request goes at 0.
    """
    if math.isinf(request_rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


class _ProgressPrinter:
    """A progress line on stderr every ~10% of completions; tqdm is not required."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self.every = max(1, total // 10)
        self.done = 0
        self.failed = 0

    def update(self, result: RequestResult) -> None:
        self.done += 1
        self.failed += not result.success
        if self.enabled and (self.done % self.every == 0 or self.done == self.total):
            line = f"[bench] {self.done}/{self.total} requests done, {self.failed} failed"
            print(line, file=sys.stderr)


def _print_errors(results: list[RequestResult], limit: int = 3) -> None:
    """Show the first few distinct errors so a failing run explains itself."""
    distinct = list(dict.fromkeys(r.error for r in results if not r.success))
    for error in distinct[:limit]:
        print(f"[bench] request failed: {error}", file=sys.stderr)
    if len(distinct) > limit:
        print(f"[bench] ... and {len(distinct) - limit} more distinct errors", file=sys.stderr)


def _result_extra(args: BenchServingArgs, results: list[RequestResult]) -> dict[str, Any]:
    """Run settings (and per-request details if asked) stored next to the metrics."""
    keys = [
        "backend", "model", "dataset_name", "request_rate", "max_concurrency", "num_prompts",
        "seed", "sharegpt_output_len", "random_input_len", "random_output_len",
        "random_range_ratio", "lora_name",
    ]  # fmt: skip
    if args.dataset_name == "image":
        keys += ["image_count", "image_resolution", "image_format"]
    if args.dataset_name == "generated-shared-prefix":
        keys += [f.name for f in dataclasses.fields(args) if f.name.startswith("gsp_")]
    extra: dict[str, Any] = {key: getattr(args, key) for key in keys}
    # What ``engine bench report`` needs beside the figures (the server's device is not known here).
    extra.update(bench="serving", command=run_command(),
                 date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"))
    if args.output_details:
        extra.update(
            input_lens=[r.prompt_len for r in results],
            output_lens=[r.output_len for r in results],
            ttfts=[r.ttft for r in results],
            itls=[r.itl for r in results],
            generated_texts=[r.generated_text for r in results],
            errors=[r.error for r in results],
        )
    return extra
