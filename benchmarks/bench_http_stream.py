"""CPU cost of the server's HTTP process per streamed token, without a model.

Runs the real ASGI app and tokenizer manager (``create_app``, uvicorn, ZeroMQ) in one process,
a stand-in for the scheduler and detokenizer in a second (every ``--step-ms`` it sends one
``BatchStrOut`` holding one new token for every running request, as the detokenizer does at
``--stream-interval 1``), and ``--streams`` concurrent streaming clients in a third. It prints
the HTTP process's CPU seconds over the run (user + system, from /proc) divided by the tokens
the clients received, per route; ``tail_s``: how long after the stand-in's last step the
clients received their last byte (an HTTP process that falls behind delivers the end late);
``arrivals_s``: when the stand-in received the first, the middle and the last request of those
that reached it (``arrived``), in seconds from the clients' start (how fast the HTTP process takes
in a burst; ``--prompt-len`` sets the size of each request).
Linux only; runs on the CPU.

    python3 benchmarks/bench_http_stream.py --streams 64 --output-len 256 --routes generate completions chat

``--profile FILE`` records the HTTP process with py-spy (``--format raw``: collapsed stacks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import socket
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any

ROUTES = {
    "generate": "/generate",
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}


def _body(route: str, output_len: int, prompt_len: int) -> dict[str, Any]:
    ids = [5 + i % 40 for i in range(prompt_len)]
    if route == "generate":
        return {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": output_len}}
    if route == "completions":
        return {"prompt": ids, "stream": True, "max_tokens": output_len}
    return {"messages": [{"role": "user", "content": "hello"}], "stream": True, "max_tokens": output_len}


def _serve(port: int, ipc_dir: str, ckpt: str, extra: dict[str, Any]) -> None:
    import uvicorn

    from engine.config import ServerArgs
    from engine.entrypoints.http_server import create_app
    from engine.managers.io_struct import SchedulerReady
    from engine.managers.tokenizer_utils import load_tokenizer

    args = ServerArgs(model_path=ckpt, **extra)
    tokenizer = load_tokenizer(ckpt)
    ready = SchedulerReady(max_total_num_tokens=1 << 20, max_running_requests=4096, context_len=1 << 16,
                           vocab_size=len(tokenizer), device="cpu", attention_backend="torch_native", platform="cpu",
                           dtype="float32", eos_token_ids=[3], plugins=[])
    ipc = SimpleNamespace(tokenizer=f"ipc://{ipc_dir}/tok", replica_scheduler=lambda r: f"ipc://{ipc_dir}/s{r}")
    runtime = SimpleNamespace(args=args, model_path=ckpt, ipc=ipc, ready=ready, processes=[])
    app = create_app(runtime, tokenizer)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")


def _scheduler(ipc_dir: str, step_s: float, last_step: Any, arrivals: Any, arrived: Any) -> None:
    """One token for every running request each step, finishing each at its max_new_tokens;
    ``last_step.value``: the monotonic time of the step that finished the last running request;
    ``arrivals``: the monotonic times requests arrived at, in order (a shared array);
    ``arrived.value``: how many requests arrived since the parent last set it to 0 (the first
    ``len(arrivals)`` of them have their time recorded)."""
    import zmq

    from engine.managers.io_struct import (
        AbortReq,
        BatchStrOut,
        ControlReply,
        ControlReq,
        TokenizedGenerateReqInput,
    )

    ctx = zmq.Context()
    recv, send = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    recv.bind(f"ipc://{ipc_dir}/s0")
    send.connect(f"ipc://{ipc_dir}/tok")
    running: dict[str, list[int]] = {}  # rid -> [prompt tokens, produced, max_new_tokens]
    next_step = time.perf_counter()
    while True:
        timeout = max(0.0, next_step - time.perf_counter()) if running else 100.0
        while recv.poll(int(timeout * 1000)):
            msg = recv.recv_pyobj()
            if isinstance(msg, TokenizedGenerateReqInput):
                if arrived.value < len(arrivals):
                    arrivals[arrived.value] = time.monotonic()
                arrived.value += 1
                if not running:  # the first request after an idle spell: steps start now
                    next_step = time.perf_counter() + step_s
                running[msg.rid] = [len(msg.input_ids), 0, int(msg.sampling_params.get("max_new_tokens") or 16)]
            elif isinstance(msg, AbortReq):
                running.pop(msg.rid, None)
            elif isinstance(msg, ControlReq):
                send.send_pyobj(ControlReply(msg.kind, msg.token, True, {}))
            timeout = max(0.0, next_step - time.perf_counter()) if running else 0.0
        if not running:
            next_step = time.perf_counter()
            continue
        step_time = time.monotonic()
        rids = list(running)
        reasons: list[dict[str, Any] | None] = []
        for rid in rids:
            entry = running[rid]
            entry[1] += 1
            reasons.append({"type": "length", "length": entry[1]} if entry[1] >= entry[2] else None)
        send.send_pyobj(BatchStrOut(
            rids, [" tok"] * len(rids), [[7 + running[r][1] % 50] for r in rids], reasons,
            [running[r][0] for r in rids], [running[r][1] for r in rids], [0] * len(rids)))
        for rid, reason in zip(rids, reasons, strict=True):
            if reason is not None:
                del running[rid]
        if not running:
            last_step.value = step_time
        next_step += step_s


async def _one_stream(port: int, path: str, body: bytes) -> tuple[int, int, float]:
    """Sends one request; returns (events, bytes) of its SSE response and when it ended (monotonic)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    events = size = 0
    tail = b""
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"{path}: {head.decode(errors='replace')}{(await reader.read(2000)).decode(errors='replace')}")
    while chunk := await reader.read(1 << 16):
        size += len(chunk)
        data = tail + chunk
        events += data.count(b"data: ") - tail.count(b"data: ")
        tail = data[-8:]
    writer.close()
    return events, size, time.monotonic()


def _clients(port: int, path: str, body: bytes, streams: int, result: Any) -> None:
    """Puts (start, each stream's (events, bytes, end)) into ``result``, or (start, why) when a
    stream failed (the parent then stops rather than wait for a result that never comes)."""
    async def run() -> list[tuple[int, int, float]]:
        return await asyncio.gather(*(_one_stream(port, path, body) for _ in range(streams)))

    start = time.monotonic()
    try:
        result.put((start, asyncio.run(run())))
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported by the parent, which exits
        result.put((start, str(exc) or type(exc).__name__))


def arrival_times(arrivals: Any, arrived: int, start: float) -> list[float]:
    """Seconds from ``start`` to the first, the middle and the last of the ``arrived`` requests
    whose times ``arrivals`` holds (entries past them are an earlier run's); [] for none."""
    n = min(arrived, len(arrivals))
    return [round(arrivals[i] - start, 3) for i in (0, n // 2, n - 1)] if n else []


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _result_of(process: Any, result: Any, what: str) -> Any:
    """The client process's result, or SystemExit naming ``what`` when a stream failed (its answer
    says why) or the process ends without one (killed by a signal, or an error before it could
    answer)."""
    while True:
        try:
            answer = result.get(timeout=1.0)
            break
        except queue.Empty:
            if not process.is_alive():
                try:  # it may have answered just before it ended
                    answer = result.get(timeout=1.0)
                    break
                except queue.Empty:
                    raise SystemExit(f"{what}: the client process ended without a result "
                                     f"(exit code {process.exitcode})") from None
    if isinstance(answer[1], str):
        raise SystemExit(f"{what}: {answer[1]}")
    return answer


def _wait_port(port: int, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"the server did not listen on port {port} within {timeout:g} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64, help="concurrent streaming requests per route")
    parser.add_argument("--output-len", type=int, default=256, help="tokens each request streams")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--step-ms", type=float, default=20.0, help="time between the stand-in's decode steps")
    parser.add_argument("--routes", nargs="+", default=["generate"], choices=sorted(ROUTES))
    parser.add_argument("--stream-interval", type=int, default=1, help="the server's --stream-interval")
    parser.add_argument("--extra", default="{}", help="more ServerArgs fields, as a JSON object")
    parser.add_argument("--profile", help="record the HTTP process with py-spy into this file (raw format)")
    a = parser.parse_args()

    from engine.ports import free_port
    from engine.testing.checkpoints import make_tiny_checkpoint

    spawn = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(os.path.join(tmp, "ckpt"), "LlamaForCausalLM")
        port = free_port()
        extra = {"stream_interval": a.stream_interval, **json.loads(a.extra)}
        server = spawn.Process(target=_serve, args=(port, tmp, ckpt, extra), daemon=True)
        last_step = spawn.Value("d", 0.0)
        arrivals = spawn.Array("d", a.streams, lock=False)
        arrived = spawn.Value("i", 0, lock=False)
        scheduler = spawn.Process(target=_scheduler, args=(tmp, a.step_ms / 1000, last_step, arrivals, arrived),
                                  daemon=True)
        server.start()
        scheduler.start()
        try:
            _wait_port(port)
            for route in a.routes:
                body = json.dumps(_body(route, a.output_len, a.prompt_len)).encode()
                result = spawn.Queue()
                # A short warm-up (imports, first requests), then the measured run.
                warm = spawn.Process(target=_clients, args=(port, ROUTES[route], body, 2, result))
                warm.start()
                _result_of(warm, result, f"{route} (warm-up)")
                warm.join()
                spy = None
                if a.profile:
                    spy = subprocess.Popen(["py-spy", "record", "--pid", str(server.pid), "--format", "raw",
                                            "--rate", "200", "--output", f"{a.profile}.{route}"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(1.0)
                arrived.value = 0  # the stand-in records this run's arrivals from the first
                cpu0, t0 = _cpu_s(server.pid), time.perf_counter()
                clients = spawn.Process(target=_clients, args=(port, ROUTES[route], body, a.streams, result))
                clients.start()
                try:
                    m0, outs = _result_of(clients, result, route)
                finally:
                    if spy is not None:  # py-spy writes its profile on SIGINT, also when the run failed
                        spy.send_signal(2)
                        spy.wait(60)
                clients.join()
                cpu, wall = _cpu_s(server.pid) - cpu0, time.perf_counter() - t0
                events = sum(e for e, _, _ in outs)
                tokens = a.streams * a.output_len
                print(json.dumps({
                    "route": route, "streams": a.streams, "output_len": a.output_len, "step_ms": a.step_ms,
                    "stream_interval": a.stream_interval, "tokens": tokens, "events": events,
                    "bytes": sum(b for _, b, _ in outs), "wall_s": round(wall, 3),
                    "tail_s": round(max(end for _, _, end in outs) - last_step.value, 3),
                    "arrived": arrived.value, "arrivals_s": arrival_times(arrivals, arrived.value, m0),
                    "server_cpu_s": round(cpu, 3),
                    "us_per_token": round(cpu / tokens * 1e6, 2), "us_per_event": round(cpu / events * 1e6, 2),
                }), flush=True)
        finally:
            for proc in (server, scheduler):
                proc.terminate()
                proc.join(10)


if __name__ == "__main__":
    sys.exit(main())
