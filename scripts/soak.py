"""Availability benchmark and soak run against a private ``engine serve`` on 127.0.0.1.

    python3 scripts/soak.py [--model-path DIR] [--minutes 3] [--max-requests 20000] [--concurrency 16]

1. Hostile-input latency: p50/p99 of small completions when idle, then while huge
   prompts (``--huge-mb`` each, ``--huge-count`` at once) and prompts just under the
   character bound (tokenized on the pool) arrive; /health's worst answer time.
2. Soak: bounded minutes (and requests) of mixed traffic — completed streams, streams
   dropped mid-way, non-streamed requests abandoned, aborts through /abort_request,
   malformed bodies and huge prompts — then: errors (unexpected outcomes), lost requests
   (no well-formed end), KV leaked after idling, and each process's RSS at start and end.

Only 127.0.0.1; the server is started and stopped by this script (SIGTERM, drained).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import httpx

from engine.ports import free_port

MODEL = "default"


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(k) for k in f.read().split()]
    return out


def _memory(pid: int) -> dict[str, float]:
    mem = {"main": round(_rss_mb(pid), 1)}
    for i, child in enumerate(_children(pid)):
        mem[f"child{i}:{child}"] = round(_rss_mb(child), 1)
    return mem


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _small(http: httpx.AsyncClient, url: str) -> float:
    started = time.perf_counter()
    r = await http.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 4})
    r.raise_for_status()
    return time.perf_counter() - started


async def _small_latencies(http: httpx.AsyncClient, url: str, count: int, concurrency: int) -> list[float]:
    sem = asyncio.Semaphore(concurrency)

    async def one() -> float:
        async with sem:
            return await _small(http, url)

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def latency_phase(url: str, args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=200)) as http:
        idle = await _small_latencies(http, url, args.small, 4)
        info = (await http.get(url + "/get_model_info")).json()
        context = info["context_len"]
        huge = "All work and no play makes Jack a dull boy. " * int(args.huge_mb * 1024 * 1024 / 44)
        # Just under the refusal bound is found by asking: the bound is in the 400's message.
        probe = await http.post(url + "/v1/completions", json={"model": MODEL, "prompt": huge, "max_tokens": 1})
        message = probe.json()["error"]["message"]
        bound = int(message.split("holds at most ")[1].split(" ")[0]) if "holds at most" in message else 0
        near = huge[: max(bound - 10, 1)]
        health_times: list[float] = []
        stop = asyncio.Event()

        async def health_probe() -> None:
            while not stop.is_set():
                started = time.perf_counter()
                await http.get(url + "/health")
                health_times.append(time.perf_counter() - started)
                await asyncio.sleep(0.05)

        async def hostile(text: str) -> int:
            r = await http.post(url + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1})
            return r.status_code

        prober = asyncio.ensure_future(health_probe())
        hostile_tasks = [asyncio.ensure_future(hostile(huge if i % 2 == 0 else near)) for i in range(args.huge_count)]
        loaded = await _small_latencies(http, url, args.small, 4)
        codes = Counter(await asyncio.gather(*hostile_tasks))
        stop.set()
        await prober
    return {
        "context_len": context, "char_bound": bound, "huge_chars": len(huge), "near_bound_chars": len(near),
        "hostile_requests": args.huge_count, "hostile_status_codes": dict(codes),
        "idle_p50_s": round(statistics.median(idle), 4), "idle_p99_s": round(_pct(idle, 0.99), 4),
        "under_hostile_p50_s": round(statistics.median(loaded), 4), "under_hostile_p99_s": round(_pct(loaded, 0.99), 4),
        "health_max_s": round(max(health_times), 4) if health_times else None, "health_probes": len(health_times),
    }


# -- soak ---------------------------------------------------------------------------------
KINDS = ("stream", "drop_stream", "abandon", "abort", "malformed", "huge", "chat")


async def _soak_one(http: httpx.AsyncClient, url: str, kind: str, i: int, huge: str) -> str:
    """Runs one request of ``kind``; returns "ok" or a short description of what went wrong.

    "lost" marks a request with no well-formed end (a stream without [DONE], a transport error).
    """
    body: dict[str, Any] = {"model": MODEL, "prompt": f"Soak request {i}", "max_tokens": 16,
                            "ignore_eos": True, "stream": True}
    if kind in ("stream", "abort"):
        rid = f"soak-{i}"
        body.update(rid=rid, max_tokens=200 if kind == "abort" else 16)
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return f"status {r.status_code}"
            lines = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if kind == "abort" and len(lines) == 2:
                        a = await http.post(url + "/abort_request", json={"rid": rid})
                        if a.status_code not in (200, 404):  # 404: it finished first
                            return f"abort status {a.status_code}"
        if not lines or lines[-1] != "[DONE]":
            return "lost"
        last = json.loads(lines[-2]) if len(lines) > 1 else {}
        if kind == "stream" and "error" in last:
            return f"error event {last['error'].get('code')}"
        if kind == "abort" and "error" in last and last["error"].get("code") != "request_aborted":
            return f"error event {last['error'].get('code')}"
        return "ok"
    if kind == "drop_stream":
        body["max_tokens"] = 300
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 2:
                        return "ok"  # leaving the block drops the connection mid-stream
        return "lost"
    if kind == "abandon":
        try:
            await http.post(url + "/generate", timeout=0.3,
                            json={"input_ids": [5, 6, i % 1000], "sampling_params": {"max_new_tokens": 400,
                                                                                     "ignore_eos": True}})
        except httpx.TimeoutException:
            return "ok"
        return "ok"  # finished within the timeout: fine too
    if kind == "malformed":
        r = await http.post(url + "/v1/completions", content=b'{"model": "default", "prompt": ',
                            headers={"content-type": "application/json"})
        return "ok" if r.status_code == 400 and "error" in r.json() else f"status {r.status_code}"
    if kind == "huge":
        r = await http.post(url + "/v1/completions", json={"model": MODEL, "prompt": huge, "max_tokens": 1})
        return "ok" if r.status_code == 400 and "error" in r.json() else f"status {r.status_code}"
    r = await http.post(url + "/v1/chat/completions",
                        json={"model": MODEL, "messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 8})
    return "ok" if r.status_code == 200 and r.json()["choices"] else f"status {r.status_code}"


async def soak_phase(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    weights = [30, 15, 10, 10, 10, 5, 20]
    huge = "x" * int(args.huge_mb * 1024 * 1024)
    outcomes: Counter[str] = Counter()
    by_kind: Counter[str] = Counter()
    deadline = time.monotonic() + args.minutes * 60
    issued = 0
    mem_start = _memory(pid)

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.concurrency * 2)) as http:
        async def worker() -> None:
            nonlocal issued
            while time.monotonic() < deadline and issued < args.max_requests:
                issued += 1
                i = issued
                kind = rng.choices(KINDS, weights)[0]
                by_kind[kind] += 1
                try:
                    result = await _soak_one(http, url, kind, i, huge)
                except httpx.HTTPError as exc:
                    result = "lost" if kind != "abandon" else "ok"
                    if result == "lost":
                        print(f"request {i} ({kind}): {exc!r}", file=sys.stderr)
                outcomes[result if result in ("ok", "lost") else f"error: {kind} {result}"] += 1

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        # Let aborts and dropped streams settle, then read the KV accounting.
        info: dict[str, Any] = {}
        for _ in range(100):
            info = (await http.get(url + "/get_server_info")).json()
            if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["num_inflight_reqs"] == 0:
                break
            await asyncio.sleep(0.2)
    leaked = info["max_total_num_tokens"] - info["kv_free_tokens"] - info["kv_evictable_tokens"]
    return {
        "requests": issued, "by_kind": dict(by_kind), "ok": outcomes["ok"], "lost": outcomes["lost"],
        "errors": {k: v for k, v in outcomes.items() if k.startswith("error")},
        "kv_leaked_tokens": leaked, "kv_used_tokens": info["kv_used_tokens"],
        "inflight_after": info["num_inflight_reqs"], "memory_mb_start": mem_start, "memory_mb_end": _memory(pid),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--minutes", type=float, default=3.0, help="soak duration (bounded)")
    parser.add_argument("--max-requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--small", type=int, default=200, help="small requests per latency measurement")
    parser.add_argument("--huge-mb", type=float, default=10.0)
    parser.add_argument("--huge-count", type=int, default=100)
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--server-args", default="", help="extra engine serve flags")
    args = parser.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1", "--port", str(port),
           *(["--model-path", args.model_path] if args.model_path else []), *args.server_args.split()]
    log = open(f"/tmp/soak-server-{port}.log", "wb")  # noqa: SIM115 - the server writes it for its life
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    report: dict[str, Any] = {"command": " ".join(sys.argv), "server_log": log.name}
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"engine serve exited with {proc.returncode}; see {log.name}")
            time.sleep(0.5)
        report["memory_mb_ready"] = _memory(proc.pid)
        if not args.skip_latency:
            report["latency"] = asyncio.run(latency_phase(url, args))
            report["memory_mb_after_latency"] = _memory(proc.pid)
        report["soak"] = asyncio.run(soak_phase(url, proc.pid, args))
    finally:
        proc.send_signal(signal.SIGTERM)
        report["exit_code"] = proc.wait(120)
    with open(log.name, errors="replace") as f:
        text = f.read()
    report["log_errors"] = sum(1 for line in text.splitlines() if " ERROR " in line or "Traceback" in line)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
