"""``engine bench multi-turn``: multi-turn conversations against a running server.

Each of ``num_conversations`` conversations starts from its own random history of
``history_len`` token ids and runs ``num_turns`` turns; a turn's prompt is the whole conversation
so far (history, earlier user messages and the server's answers, as token ids) plus a new random
user message of ``turn_input_len`` ids. Turns go round-robin over the conversations (a finished
turn queues the conversation's next one at the back), at most ``max_concurrency`` in flight, so
between two turns of one conversation the others run: when their histories together exceed the
device KV pool, a conversation's prefix has left the pool by the time it returns, and what the
server does then (recompute it, or load it from a hierarchical cache's tier) is what this
measures. Prompts are token ids sent to the native ``/generate``, so the server needs no
tokenizer; the answers' ids come back in its stream.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import math
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from engine.bench.backends import BACKENDS, Backend, RequestOptions, auth_headers, send_request
from engine.bench.metrics import BenchMetrics, RequestResult, compute_metrics, format_report, to_json_line
from engine.bench.requests import BenchRequest
from engine.bench.results import run_command

__all__ = ["MultiTurnArgs", "TurnResult", "bench_multi_turn", "per_turn_table"]

#: ``/get_server_info`` hicache fields that are levels, not counters (reported as they are).
_TIER_LEVELS = frozenset({"hicache_host_tokens", "hicache_host_capacity_tokens"})


@dataclass
class MultiTurnArgs:
    """Settings of one multi-turn run (the flags of ``engine bench multi-turn``)."""

    # Server root such as "http://10.0.0.5:30000"; overrides host and port.
    base_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    num_conversations: int = 16
    num_turns: int = 4
    # Random token ids every conversation starts with (its own history, shared by its turns).
    history_len: int = 2048
    # Token ids of each turn's new user message.
    turn_input_len: int = 128
    # Tokens each answer generates (EOS ignored).
    output_len: int = 64
    # Turns in flight at most.
    max_concurrency: int = 8
    # Turns started per second at most (Poisson gaps); inf starts each as soon as a slot is free.
    request_rate: float = math.inf
    # Vocabulary to draw ids from; None asks the server (GET /get_server_info "vocab_size").
    vocab_size: int | None = None
    seed: int = 1
    # Empty the server's prefix cache first (POST /flush_cache), so runs start alike.
    flush_cache: bool = True
    result_file: str | None = None
    request_timeout_s: float = 600.0

    def server_url(self) -> str:
        return (self.base_url or f"http://{self.host}:{self.port}").rstrip("/")

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""
        for name in ("num_conversations", "num_turns", "turn_input_len", "output_len", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: invalid value {getattr(self, name)}; accepted: >= 1")
        if self.history_len < 0:
            raise ValueError(f"--history-len: invalid value {self.history_len}; accepted: >= 0")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate: invalid value {self.request_rate}; accepted: > 0 (inf: no limit)")
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ValueError(f"--vocab-size: invalid value {self.vocab_size}; accepted: >= 2")


@dataclass
class TurnResult:
    """One turn of one conversation: the request's timing and what the server reused."""

    conversation: int
    turn: int
    result: RequestResult
    # Prompt tokens the server did not compute (its meta_info.cached_tokens; 0 if unreported).
    cached_tokens: int = 0


def bench_multi_turn(args: MultiTurnArgs) -> tuple[BenchMetrics, list[TurnResult]]:
    """Runs the conversations, prints the report, appends the result line if asked."""
    args.validate()
    return asyncio.run(_bench(args))


async def _bench(args: MultiTurnArgs) -> tuple[BenchMetrics, list[TurnResult]]:
    url = args.server_url()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.request_timeout_s),
                                 trust_env=False) as client:
        vocab = args.vocab_size or await _server_vocab(client, url)
        rng = np.random.default_rng(args.seed)

        def ids(n: int) -> list[int]:
            # Id 0 and the top few are often special tokens; 1..vocab-1 keeps clear of 0 at least.
            return rng.integers(1, vocab, size=n).tolist()

        histories = [ids(args.history_len) for _ in range(args.num_conversations)]
        messages = [[ids(args.turn_input_len) for _ in range(args.num_turns)] for _ in range(args.num_conversations)]
        warm = await _send(client, url, ids(16), 2)  # compiles and warms the paths; not timed
        if not warm.result.success:
            raise RuntimeError(f"the warmup request to {url}/generate failed: {warm.result.error}")
        if args.flush_cache:
            flushed = await client.post(url + "/flush_cache", headers=auth_headers())
            if not flushed.is_success:
                print(f"[bench] POST {url}/flush_cache returned {flushed.status_code}: the server's prefix cache "
                      "was not emptied, so the first turns may find cached prefixes")
        before = await _hicache_counters(client, url)
        turns = await _run(args, client, url, histories, messages)
        after = await _hicache_counters(client, url)
        duration = max(r.result.start_time + r.result.latency for r in turns) - min(r.result.start_time for r in turns)
    metrics = compute_metrics([t.result for t in turns], duration)
    ok = [t for t in turns if t.result.success]
    cached = sum(t.cached_tokens for t in ok)
    prompt = sum(t.result.prompt_len for t in ok)
    # Counters over the run; the tier's fill and capacity as they are at its end.
    tier = {k: v if k in _TIER_LEVELS else v - before.get(k, 0) for k, v in after.items()}
    settings = {"Conversations x turns": f"{args.num_conversations} x {args.num_turns}",
                "History / turn input / output": f"{args.history_len} / {args.turn_input_len} / {args.output_len}",
                "Max concurrency": args.max_concurrency, "Request rate": args.request_rate}
    print(format_report(metrics, title="Multi-turn Benchmark Result", settings=settings))
    print(f"{'Cached prompt tokens:':<40} {cached} of {prompt} ({100 * cached / max(prompt, 1):.1f}%)")
    # Host hits and bytes count loads (once each); the server's device hits count every admission
    # attempt of a waiting request, so they stay in the result line only.
    for key in ("hicache_host_hit_tokens", "hicache_bytes_loaded"):
        if key in tier:
            print(f"{'Server ' + key + ':':<40} {tier[key]}")
    print(per_turn_table(turns))
    for error in list(dict.fromkeys(t.result.error for t in turns if not t.result.success))[:3]:
        print(f"[bench] request failed: {error}")
    if args.result_file:
        extra = {"bench": "multi-turn", **{k: v for k, v in dataclasses.asdict(args).items() if k != "result_file"},
                 "cached_tokens": cached, "cached_token_ratio": cached / max(prompt, 1), **tier,
                 "per_turn": _per_turn(turns), "command": run_command(),
                 "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")}
        with open(args.result_file, "a", encoding="utf-8") as f:
            f.write(to_json_line(metrics, extra) + "\n")
    return metrics, turns


async def _run(args: MultiTurnArgs, client: httpx.AsyncClient, url: str, histories: list[list[int]],
               messages: list[list[list[int]]]) -> list[TurnResult]:
    """Round-robin turns over ``max_concurrency`` workers; a conversation's next turn is queued
    behind every other waiting conversation when its current one finishes."""
    queue: collections.deque[tuple[int, int]] = collections.deque((c, 0) for c in range(len(histories)))
    done: list[TurnResult] = []
    wake = asyncio.Event()
    in_flight = 0
    gaps = np.random.default_rng(args.seed + 1)
    next_start = time.perf_counter()

    async def worker() -> None:
        nonlocal in_flight, next_start
        while True:
            while not queue:
                if in_flight == 0:
                    wake.set()  # nothing will be queued any more: every worker may stop
                    return
                wake.clear()
                await wake.wait()
            conv, turn = queue.popleft()
            if math.isfinite(args.request_rate):
                next_start = max(next_start, time.perf_counter()) + gaps.exponential(1.0 / args.request_rate)
                await asyncio.sleep(max(0.0, next_start - time.perf_counter()))
            in_flight += 1
            prompt = histories[conv] + messages[conv][turn]
            out = await _send(client, url, prompt, args.output_len, conv, turn)
            done.append(out)
            # The answer joins the history; a failed turn's stand-in keeps the lengths planned.
            answer = out.output_ids if out.output_ids else [1] * args.output_len
            histories[conv] = prompt + answer
            if turn + 1 < args.num_turns:
                queue.append((conv, turn + 1))
            in_flight -= 1
            wake.set()

    await asyncio.gather(*(worker() for _ in range(args.max_concurrency)))
    return sorted(done, key=lambda t: (t.turn, t.conversation))


@dataclass
class _Sent(TurnResult):
    output_ids: list[int] = dataclasses.field(default_factory=list)


async def _send(client: httpx.AsyncClient, url: str, prompt: list[int], output_len: int, conv: int = -1,
                turn: int = -1) -> _Sent:
    """One streamed /generate of ``prompt`` (token ids), timed by the shared serving loop."""
    native = BACKENDS["engine"]
    seen: dict[str, Any] = {}

    def parse(data: dict[str, Any]) -> Any:
        meta = data.get("meta_info") or {}
        if "cached_tokens" in meta:
            seen["cached"] = int(meta["cached_tokens"])
        if isinstance(data.get("output_ids"), list):
            seen["ids"] = data["output_ids"]
        return native.parse(data)

    backend = Backend(native.path, native.build_payload, parse, needs_model=False)
    opts = RequestOptions(model=None, stream=True, ignore_eos=True, extra_body={}, headers=auth_headers())
    req = BenchRequest(prompt=prompt, prompt_len=len(prompt), output_len=output_len)
    result = await send_request(client, url, backend, req, opts)
    return _Sent(conv, turn, result, seen.get("cached", 0), list(seen.get("ids", [])))


async def _server_info(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    response = await client.get(url + "/get_server_info", headers=auth_headers())
    response.raise_for_status()
    return response.json()  # type: ignore[no-any-return]


async def _server_vocab(client: httpx.AsyncClient, url: str) -> int:
    try:
        vocab = (await _server_info(client, url)).get("vocab_size")
    except (httpx.HTTPError, ValueError) as exc:
        raise ValueError(f"cannot read vocab_size from {url}/get_server_info ({exc}); pass --vocab-size") from exc
    if not isinstance(vocab, int) or vocab < 2:
        raise ValueError(f"{url}/get_server_info has no usable vocab_size ({vocab!r}); pass --vocab-size")
    return vocab


async def _hicache_counters(client: httpx.AsyncClient, url: str) -> dict[str, int]:
    """The server's hierarchical-cache token and byte counters, summed over its schedulers
    (empty when it reports none)."""
    try:
        info = await _server_info(client, url)
    except (httpx.HTTPError, ValueError) as exc:
        print(f"[bench] cannot read {url}/get_server_info ({exc}); the hierarchical-cache counters are left out")
        return {}
    totals: dict[str, int] = {}

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if "hicache_host_hit_tokens" in value:
                for k, v in value.items():
                    if k.startswith("hicache_") and isinstance(v, int):
                        totals[k] = totals.get(k, 0) + v
                return
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(info)
    return totals


def _per_turn(turns: list[TurnResult]) -> list[dict[str, Any]]:
    rows = []
    for turn in sorted({t.turn for t in turns}):
        ok = [t for t in turns if t.turn == turn and t.result.success]
        if not ok:
            continue
        ttft = np.asarray([t.result.ttft for t in ok]) * 1000
        prompt = sum(t.result.prompt_len for t in ok)
        rows.append({"turn": turn, "requests": len(ok), "mean_prompt_len": prompt / len(ok),
                     "median_ttft_ms": float(np.median(ttft)), "p90_ttft_ms": float(np.percentile(ttft, 90)),
                     "cached_ratio": sum(t.cached_tokens for t in ok) / max(prompt, 1)})
    return rows


def per_turn_table(turns: list[TurnResult]) -> str:
    """Per turn index: requests, mean prompt length, TTFT median and p90, cached share."""
    lines = [f"{'turn':>4} {'reqs':>5} {'prompt':>8} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'cached':>7}"]
    for r in _per_turn(turns):
        lines.append(f"{r['turn']:>4} {r['requests']:>5} {r['mean_prompt_len']:>8.0f} {r['median_ttft_ms']:>12.1f} "
                     f"{r['p90_ttft_ms']:>12.1f} {100 * r['cached_ratio']:>6.1f}%")
    return "\n".join(lines)
