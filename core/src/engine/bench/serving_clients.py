"""The sending side of ``engine bench serving``: one event loop, or several client processes.

One Python process spends ~0.1 ms of CPU on each streamed event (HTTP parsing, JSON), so a
burst of 1,000 streams that each get a token every step of a fast server can keep it busy: the
client then measures its own delays. ``--client-processes N`` splits the requests over N spawned
processes (request ``i`` goes to process ``i % N``), each with its own event loop and
connections, all starting at one instant of the system's monotonic clock (``time.perf_counter``
on Linux), so arrival times and latencies stay comparable.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Callable
from typing import Any

import httpx

from engine.bench.backends import BACKENDS, RequestOptions, auth_headers, send_request
from engine.bench.datasets import BenchRequest, TokenizerLike
from engine.bench.json_schema import load_bench_schema
from engine.bench.metrics import RequestResult
from engine.bench.serving_args import BenchServingArgs

#: Seconds between all client processes reporting ready and their common start.
START_LEAD_S = 0.2


def request_options(args: BenchServingArgs) -> RequestOptions:
    """What every request of the run shares."""
    return RequestOptions(
        model=args.model,
        stream=not args.disable_stream,
        ignore_eos=not args.disable_ignore_eos,
        extra_body=dict(args.extra_request_body or {}),
        headers=auth_headers(args.api_key),
        json_schema=load_bench_schema(args.json_schema),
        json_schema_unique=args.json_schema_unique,
    )


def make_client(args: BenchServingArgs) -> httpx.AsyncClient:
    """An HTTP client for the run's requests.

    No pool cap: httpx's default of 100 connections would silently queue requests and hide the
    server's queueing behind the client's. trust_env=False keeps proxies out of the measured path.
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.request_timeout_s), trust_env=False)


async def send_on_schedule(client: httpx.AsyncClient, args: BenchServingArgs, requests: list[BenchRequest],
                           offsets: list[float], start: float, tokenizer: TokenizerLike | None = None,
                           on_done: Callable[[RequestResult], None] | None = None,
                           opts: RequestOptions | None = None) -> list[RequestResult]:
    """Sends request ``i`` at ``start + offsets[i]`` (perf_counter seconds), at most
    ``args.max_concurrency`` at once; the results in ``requests`` order. ``opts``: the caller's
    ``request_options(args)`` when it has them (default: built here)."""
    opts = opts if opts is not None else request_options(args)
    backend, base_url = BACKENDS[args.backend], args.server_url()
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    async def one(req: BenchRequest) -> RequestResult:
        if semaphore is None:
            result = await send_request(client, base_url, backend, req, opts, tokenizer)
        else:
            async with semaphore:
                result = await send_request(client, base_url, backend, req, opts, tokenizer)
        if on_done is not None:
            on_done(result)
        return result

    tasks = []
    for req, offset in zip(requests, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    return list(await asyncio.gather(*tasks))


async def send_in_processes(args: BenchServingArgs, requests: list[BenchRequest], offsets: list[float],
                            processes: int, tokenizer: TokenizerLike | None = None,
                            on_start: Callable[[float], None] | None = None
                            ) -> tuple[list[RequestResult], float, float, list[float]]:
    """Sends ``requests`` from ``processes`` spawned client processes.

    Returns:
        The results in ``requests`` order, the common start and the last process's end
        (perf_counter seconds), and each process's CPU seconds over its part.
    """
    ctx = multiprocessing.get_context("spawn")
    loop = asyncio.get_running_loop()
    shards = [list(range(i, len(requests), processes)) for i in range(processes)]
    pipes, procs = [], []
    try:
        for shard in shards:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client_process, daemon=True, args=(
                child, args, [requests[i] for i in shard], [offsets[i] for i in shard], tokenizer))
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        for pipe in pipes:  # each says ready once its imports are done
            await loop.run_in_executor(None, _receive, pipe)
        start = time.perf_counter() + START_LEAD_S
        for pipe in pipes:
            pipe.send(start)
        if on_start is not None:
            on_start(start)
        replies = await asyncio.gather(*(loop.run_in_executor(None, _receive, pipe) for pipe in pipes))
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    results: list[RequestResult] = [RequestResult()] * len(requests)
    for shard, (part, _, _) in zip(shards, replies, strict=True):
        for i, result in zip(shard, part, strict=True):
            results[i] = result
    return results, start, max(end for _, end, _ in replies), [cpu for _, _, cpu in replies]


def _receive(pipe: Any) -> Any:
    """The next message from a client process; its error, raised here, if it failed."""
    try:
        message = pipe.recv()
    except EOFError:
        raise RuntimeError("a client process of --client-processes exited without its results") from None
    if isinstance(message, BaseException):
        raise message
    return message


def _client_process(pipe: Any, args: BenchServingArgs, requests: list[BenchRequest], offsets: list[float],
                    tokenizer: TokenizerLike | None) -> None:
    """One client process: says ready (its event loop and HTTP client made: httpx loads its
    certificates then), waits for the common start, sends its share and returns (results, end,
    CPU seconds) over ``pipe``."""
    try:
        async def run() -> tuple[list[RequestResult], float]:
            async with make_client(args) as client:
                pipe.send("ready")
                start = pipe.recv()  # nothing else runs on this loop yet: blocking is fine
                cpu = time.process_time()
                results = await send_on_schedule(client, args, requests, offsets, start, tokenizer)
                return results, time.process_time() - cpu

        results, cpu = asyncio.run(run())
        pipe.send((results, time.perf_counter(), cpu))
    except BaseException as exc:  # noqa: BLE001 - handed to the parent, which raises it
        pipe.send(RuntimeError(f"client process failed: {type(exc).__name__}: {exc}"))
