"""Prefill/decode disaggregation on one machine: a prefill server, a decode server and the router,
for each KV transfer backend given, against the decode server serving the same prompts whole.

Per backend: both servers start side by side (``--mem-fraction-static`` each, so a pair shares
one GPU), the router in front. The prompts (random token ids, ``--input-len`` each) first run
whole on the decode server, streamed one at a time: the reference outputs and the single-server
TTFT/ITL. Both prefix caches are flushed, then the same prompts run through the router, one at a
time: greedy outputs must match the reference token for token, and each request's KV transfer
is read from both servers' ``/get_server_info`` (``disaggregation.recent``): bytes, the prefill
side's staging (device to host), the transfer (send to arrival), the decode side's write into
its pool, and the decode server's wait from the request's arrival to its KV. The prefill side's
figures are ``stage_s`` (its scheduler thread's time on the KV: the gather and queuing its
copy) and ``copy_s`` (how long the copy to host memory ran on after the batch ended, overlapped
with the next batches; null where the payload stays on the device). Then, with
``--load-prompts N``, N other prompts arriving ``--arrival-interval-s`` apart, first whole on the
decode server and then through the router (caches flushed before each): throughput, TTFT and ITL
(mean and p99 over every gap), where each new prompt's prefill competes with running decodes.

Prints JSON lines: one per request (``"kind": "request"``) and, per backend, a summary row of
docs/benchmarks.md (``"kind": "summary"``; a second one for the load phase); ``--result-file``
appends the summaries.

    python3 benchmarks/bench_disaggregation.py --model-path docs/bench_configs/qwen3-0.6b \\
        --load-format dummy --input-len 4096 --output-len 128 --num-prompts 2 --load-prompts 16 \\
        --backend cuda_ipc --backend zmq --mem-fraction-static 0 \\
        --extra "--attention triton --max-total-tokens 131072 --cuda-graph-max-bs 16 --max-running-requests 16"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from engine.bench.results import append_rows
from engine.bench.startup import free_port

_BEGIN = time.perf_counter()
# Server log lines worth printing once both are up (where start-up time went).
_STARTUP_WORDS = ("model loaded", "graph", "KV pool", "disaggregation:", "warm")


def _on_term(*_: Any) -> None:
    raise TimeoutError("stopped by SIGTERM (a time limit)")


def _say(what: str) -> None:
    print(f"[{time.perf_counter() - _BEGIN:6.1f} s] {what}", file=sys.stderr, flush=True)


def _device() -> tuple[str, str]:
    """The GPU's name as nvidia-smi gives it (no CUDA context here), else the CPU's."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout.splitlines()
        if out:
            return f"cuda:0 {out[0].strip()}", "gpu"
    except (OSError, subprocess.SubprocessError):
        pass
    return f"CPU: {platform.machine()}, {os.cpu_count()} cores", "cpu"


def _wait(urls: list[str], procs: list[subprocess.Popen[bytes]], logs: list[str], timeout_s: float) -> list[float]:
    """Waits for every URL's /health; returns each one's seconds from now to healthy."""
    begin = time.monotonic()
    deadline = begin + timeout_s
    report = begin + 10
    ready: dict[str, float] = {}
    while time.monotonic() < deadline:
        if time.monotonic() > report:  # where a slow start stands: each log's last line
            report += 10
            for log in logs:
                last = _tail(log, 400).strip().splitlines()
                _say(f"waiting; {os.path.basename(log)}: {last[-1] if last else '(empty)'}")
        for proc, log in zip(procs, logs, strict=True):
            if proc.poll() is not None:
                raise RuntimeError(f"a process exited with {proc.returncode}; log tail:\n{_tail(log)}")
        for url in urls:
            if url in ready:
                continue
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    ready[url] = time.monotonic() - begin
                    _say(f"{url} healthy after {ready[url]:.1f} s")
            except httpx.HTTPError:
                pass
        if len(ready) == len(urls):
            return [ready[u] for u in urls]
        time.sleep(0.2)
    late = [u for u in urls if u not in ready]
    raise RuntimeError(f"{' '.join(late)} not healthy within {timeout_s} s; logs: {' '.join(logs)}")


def _dump_stacks(procs: list[subprocess.Popen[bytes]]) -> None:
    """Where servers that did not start are stuck: py-spy's dump of each and its children, when
    py-spy is installed."""
    spy = shutil.which("py-spy")
    if spy is None:
        _say("py-spy not installed: no stack dump")
        return
    for proc in procs:
        if proc.poll() is None:
            out = subprocess.run([spy, "dump", "--subprocesses", "--pid", str(proc.pid)], capture_output=True,
                                 text=True, timeout=20)
            print(f"--- py-spy dump of {proc.pid}\n{out.stdout[-12000:]}{out.stderr[-1000:]}", flush=True)


def _tail(path: str, n: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


@contextmanager
def _processes(cmds: list[list[str]], log_dir: str) -> Iterator[tuple[list[subprocess.Popen[bytes]], list[str]]]:
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for i, cmd in enumerate(cmds):
            logs.append(os.path.join(log_dir, f"proc-{len(os.listdir(log_dir))}-{i}.log"))
            with open(logs[-1], "wb") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))
        yield procs, logs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def _stream(url: str, body: dict[str, Any], gaps: bool = False) -> dict[str, Any]:
    """One streamed /generate: its output ids, TTFT and inter-token gaps."""
    start = time.perf_counter()
    times: list[float] = []
    ids: list[int] = []
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=300, trust_env=False) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}/generate answered {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{url}/generate streamed an error: {event['error']}")
            now = time.perf_counter()
            got = event.get("output_ids") or []
            new = got[len(ids):] if got[: len(ids)] == ids else got  # cumulative or per-event ids
            ids.extend(new)
            times.extend([now] * len(new))
    between = [b - a for a, b in zip(times, times[1:], strict=False) if b > a]
    steps = len(times) - 1
    out = {"ids": ids, "ttft_s": times[0] - start if times else None,
           "itl_s": (times[-1] - times[0]) / steps if steps > 0 else None,
           "itl_p99_s": _p99(between),
           "e2e_s": time.perf_counter() - start}
    if gaps:
        out["gaps"] = between
    return out


def _info(url: str) -> dict[str, Any]:
    return httpx.get(url + "/get_server_info", timeout=10, trust_env=False).json()


def _recent(url: str) -> dict[str, dict[str, Any]]:
    info = _info(url)
    block = info.get("disaggregation") or {}
    return {row["rid"]: row for row in block.get("recent", [])}


def _prefill_side(url: str, n: int) -> dict[str, Any]:
    """The prefill server's staging figures of its last ``n`` requests (the load phase's): the
    scheduler thread's seconds per request and the host copy's run after the batch ended (ms),
    and its staging counters so far (the pinned pool: payloads that took fresh memory, waits)."""
    block = _info(url).get("disaggregation") or {}
    rows = (block.get("recent") or [])[-n:]
    return {"prefill_stage_ms": _mean_ms([r.get("stage_s") for r in rows]),
            "prefill_copy_ms": _mean_ms([r.get("copy_s") for r in rows]), "prefill_staging": block.get("staging")}


def _flush(*urls: str) -> None:
    """Empties the servers' prefix caches (retried while a just-finished request is still leaving)."""
    for url in urls:
        deadline = time.monotonic() + 10
        while (r := httpx.post(url + "/flush_cache", timeout=30, trust_env=False)).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}/flush_cache answered {r.status_code}: {r.text[:300]}")
            time.sleep(0.1)


def _p99(xs: list[float]) -> float | None:
    """The 99th percentile (nearest rank below) of ``xs``; None for none."""
    return sorted(xs)[int(0.99 * (len(xs) - 1))] if xs else None


def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def _mean_ms(seconds: list[Any]) -> float | None:
    """The mean of the given seconds (None ignored) in milliseconds, 3 decimals; None if none."""
    mean = _mean(seconds)
    return None if mean is None else round(mean * 1e3, 3)


def _prompts(a: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """The measured prompts and the load phase's: seeded, so every backend gets the same ones."""
    rng = random.Random(0)
    top = min(vocab, 20000)
    prompts = [[rng.randrange(3, top) for _ in range(a.input_len)] for _ in range(a.num_prompts)]
    return prompts, [[rng.randrange(3, top) for _ in range(a.input_len)] for _ in range(a.load_prompts)]


def _run_backend(a: argparse.Namespace, backend: str, log_dir: str) -> None:
    p_port, d_port, r_port, boot = free_port(), free_port(), free_port(), free_port()
    model = ["--model-path", a.model_path] if a.model_path else []
    common = [sys.executable, "-m", "engine", "serve", *model, "--load-format", a.load_format,
              "--skip-tokenizer-init", "--log-level", a.server_log_level,
              "--disaggregation-transfer-backend", backend, *shlex.split(a.extra)]
    if a.mem_fraction_static:
        common += ["--mem-fraction-static", str(a.mem_fraction_static)]
    for option in a.plugin_option:
        common += ["--plugin-option", option]
    prefill = [*common, "--port", str(p_port), "--disaggregation-mode", "prefill",
               "--disaggregation-bootstrap-port", str(boot)]
    decode = [*common, "--port", str(d_port), "--disaggregation-mode", "decode"]
    p_url, d_url, r_url = (f"http://127.0.0.1:{p}" for p in (p_port, d_port, r_port))
    t0 = time.perf_counter()
    with _processes([prefill, decode], log_dir) as (procs, logs):
        try:
            ready_s = _wait([p_url, d_url], procs, logs, a.start_timeout_s)
        except RuntimeError:
            _dump_stacks(procs)
            raise
        started_s = time.perf_counter() - t0
        _say(f"{backend}: both servers ready in {started_s:.1f} s (prefill {ready_s[0]:.1f} s, decode {ready_s[1]:.1f} s)")
        for log in logs:  # what start-up cost: weights, pool, graph capture
            lines = [x for x in _tail(log, 20000).splitlines() if "] " in x[:30] and any(w in x for w in _STARTUP_WORDS)]
            _say(f"{os.path.basename(log)}:\n  " + "\n  ".join(lines[-6:]))
        router = [sys.executable, "-m", "engine", "router", "--prefill", p_url, "--decode", d_url,
                  "--port", str(r_port), "--log-level", "warning"]
        with _processes([router], log_dir) as (router_procs, router_logs):
            _wait([r_url], router_procs, router_logs, 60)
            _say(f"{backend}: router ready")
            greedy = {"temperature": 0, "max_new_tokens": a.output_len, "ignore_eos": True}
            vocab = int(_info(d_url)["vocab_size"])
            prompts, load_prompts = _prompts(a, vocab)
            # Warm-up: one prompt, then (before a load phase) a burst of 4 at once on each path, so
            # kernels first compiled for batched prefills and decodes are not timed in either run.
            rng = random.Random(99)
            warm = [[rng.randrange(3, min(vocab, 20000)) for _ in range(a.input_len)] for _ in range(10)]
            short = {**greedy, "max_new_tokens": 8}
            _stream(d_url, {"input_ids": warm[0], "sampling_params": short})
            _stream(r_url, {"input_ids": warm[1], "sampling_params": short})
            if a.load_prompts:
                _load_phase(d_url, warm[2:6], short, 0.0)
                _load_phase(r_url, warm[6:10], short, 0.0)
            _say(f"{backend}: warmed up")
            whole = [_stream(d_url, {"input_ids": p, "sampling_params": greedy}) for p in prompts]
            _say(f"{backend}: reference (whole) done")
            _flush(p_url, d_url)
            rids = [f"bench-{backend}-{i}-{random.getrandbits(32):08x}" for i in range(len(prompts))]
            disagg = [_stream(r_url, {"input_ids": p, "sampling_params": greedy, "rid": rid})
                      for p, rid in zip(prompts, rids, strict=True)]
            _say(f"{backend}: disaggregated done")
            pre, dec = _recent(p_url), _recent(d_url)
            rows = []
            for i, (w, d, rid) in enumerate(zip(whole, disagg, rids, strict=True)):
                same = sum(1 for x, y in zip(w["ids"], d["ids"], strict=False) if x == y)
                first_diff = next((j for j, (x, y) in enumerate(zip(w["ids"], d["ids"], strict=False)) if x != y), None)
                row = {"kind": "request", "backend": backend, "prompt": i, "rid": rid,
                       "match": w["ids"] == d["ids"], "first_difference": first_diff, "same_tokens": same,
                       "tokens": len(d["ids"]),
                       "whole": {k: w[k] for k in ("ttft_s", "itl_s", "itl_p99_s", "e2e_s")},
                       "disaggregated": {k: d[k] for k in ("ttft_s", "itl_s", "itl_p99_s", "e2e_s")},
                       "prefill_side": pre.get(rid), "decode_side": dec.get(rid)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            info_p, info_d = _info(p_url).get("disaggregation", {}), _info(d_url).get("disaggregation", {})
            info_p.pop("recent", None)
            info_d.pop("recent", None)
            summary = _summary(a, backend, rows, started_s, info_p, info_d)
            summary["server_ready_s"] = {"prefill": round(ready_s[0], 1), "decode": round(ready_s[1], 1)}
            _emit(a, summary, t0)  # now: a time limit during the load phase keeps it
            if a.load_prompts:
                load: dict[str, Any] = {}
                for mode, url in (("whole", d_url), ("disaggregated", r_url)):
                    _flush(p_url, d_url)
                    load[mode] = _load_phase(url, load_prompts, greedy, a.arrival_interval_s)
                    _say(f"{backend}: load phase {mode} done")
                load["disaggregated"].update(_prefill_side(p_url, len(load_prompts)))
                _emit(a, _under_load(a, summary, load), t0)


def _model_name(a: argparse.Namespace) -> str:
    if not a.model_path:
        return "default model (SmolLM2-135M-Instruct)"
    name = os.path.basename(a.model_path.rstrip("/"))
    return f"{name} shape" if a.load_format == "dummy" else name


def _emit(a: argparse.Namespace, row: dict[str, Any], t0: float) -> None:
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(row), flush=True)
    append_rows(a.result_file, row)  # the row's own command and date stand


def _names(a: argparse.Namespace, backend: str) -> tuple[str, str]:
    group = f" (process group {a.group})" if backend == "torch" and a.group else ""
    where = "prefill and decode servers on one GPU" if a.device_kind == "gpu" else "prefill and decode servers on one machine"
    return f"{backend} transfer{group}", where


def _summary(a: argparse.Namespace, backend: str, rows: list[dict[str, Any]], started_s: float,
             info_p: dict[str, Any], info_d: dict[str, Any]) -> dict[str, Any]:
    """The one-at-a-time phase's row for docs/benchmarks.md (the whole-server run as its peer)."""
    dec_rows = [r["decode_side"] or {} for r in rows]
    pre_rows = [r["prefill_side"] or {} for r in rows]
    transfer, where = _names(a, backend)
    return {
        "kind": "summary", "bench": "disaggregation", "area": "disaggregation",
        "config": (f"{_model_name(a)}, {a.input_len} in / {a.output_len} out, "
                   f"{len(rows)} requests one at a time, {transfer}, {where}"),
        "command": "python3 benchmarks/bench_disaggregation.py " + shlex.join(a.argv),
        "device": a.device, "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "backend": backend, "model_path": a.model_path, "input_len": a.input_len, "output_len": a.output_len,
        "num_prompts": len(rows), "servers_start_s": round(started_s, 1),
        "all_match": all(r["match"] for r in rows),
        "kv_mib": (_mean([r.get("bytes") for r in dec_rows]) or 0) / 2**20,
        "prefill_stage_ms": _mean_ms([r.get("stage_s") for r in pre_rows]),
        "prefill_copy_ms": _mean_ms([r.get("copy_s") for r in pre_rows]),
        "transfer_ms": _mean_ms([r.get("transfer_s") for r in dec_rows]),
        "decode_upload_ms": _mean_ms([r.get("upload_s") for r in dec_rows]),
        "decode_write_ms": _mean_ms([r.get("write_s") for r in dec_rows]),
        "decode_wait_ms": _mean_ms([r.get("wait_s") for r in dec_rows]),
        "ttft_ms": _mean_ms([r["disaggregated"]["ttft_s"] for r in rows]),
        "itl_ms": _mean_ms([r["disaggregated"]["itl_s"] for r in rows]),
        "itl_p99_ms": _mean_ms([r["disaggregated"]["itl_p99_s"] for r in rows]),
        "peer": {"config": "the decode server serving the same prompts whole, same run",
                 "ttft_ms": _mean_ms([r["whole"]["ttft_s"] for r in rows]),
                 "itl_ms": _mean_ms([r["whole"]["itl_s"] for r in rows]),
                 "itl_p99_ms": _mean_ms([r["whole"]["itl_p99_s"] for r in rows])},
        "prefill_counts": info_p, "decode_counts": info_d,
    }


def _under_load(a: argparse.Namespace, summary: dict[str, Any], load: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The load phase's row: ITL p99 against the whole-server run of the same arrivals."""
    transfer, where = _names(a, summary["backend"])
    return {
        **{k: summary[k] for k in ("kind", "bench", "area", "command", "device", "date", "backend", "model_path",
                                   "input_len", "output_len")},
        "config": (f"{_model_name(a)}, {a.input_len} in / {a.output_len} out, "
                   f"{a.load_prompts} requests arriving every {a.arrival_interval_s * 1e3:g} ms, {transfer}, {where}"),
        "figure": "itl_p99", "num_prompts": a.load_prompts, **load["disaggregated"],
        "peer": {"config": "the decode server serving the same requests whole, same run", **load["whole"]},
    }


def _load_phase(url: str, prompts: list[list[int]], greedy: dict[str, Any], interval_s: float) -> dict[str, Any]:
    """The prompts streamed with arrivals ``interval_s`` apart: throughput, TTFT and ITL (mean and
    p99 over every gap of every request), in ms."""
    results: list[dict[str, Any]] = [{} for _ in prompts]

    def one(i: int) -> None:
        results[i] = _stream(url, {"input_ids": prompts[i], "sampling_params": greedy}, gaps=True)

    begin = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
        time.sleep(interval_s)
    for t in threads:
        t.join()
    took = time.perf_counter() - begin
    gaps = sorted(g for r in results for g in r.get("gaps", []))
    ttfts = [r["ttft_s"] for r in results if r.get("ttft_s") is not None]
    return {"duration_s": round(took, 3), "output_tok_s": round(sum(len(r.get("ids", [])) for r in results) / took, 1),
            "ttft_ms": round(1e3 * sum(ttfts) / max(len(ttfts), 1), 3),
            "itl_ms": round(1e3 * sum(gaps) / max(len(gaps), 1), 3),
            "itl_p99_ms": None if not gaps else round(1e3 * _p99(gaps), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="checkpoint or config directory (default: the embedded model)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--input-len", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--load-prompts", type=int, default=0,
                    help="then this many other prompts arriving --arrival-interval-s apart, whole and disaggregated "
                         "(0: not)")
    ap.add_argument("--arrival-interval-s", type=float, default=0.1)
    ap.add_argument("--backend", action="append", help="KV transfer backend (repeatable; default zmq)")
    ap.add_argument("--plugin-option", action="append", default=[], help="passed to both servers (repeatable)")
    ap.add_argument("--mem-fraction-static", type=float, default=0.35, help="each server's (0: the platform's default)")
    ap.add_argument("--extra", default="", help="more engine serve arguments for both servers")
    ap.add_argument("--start-timeout-s", type=float, default=300)
    ap.add_argument("--server-log-level", default="info", help="the servers' --log-level (their logs are printed on errors)")
    ap.add_argument("--budget-s", type=float, default=0, help="skip a backend when less than this is left (0: none)")
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    # Everything here talks to 127.0.0.1: keep any proxy of the environment out (the servers'
    # and the router's clients too).
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = ",".join(
        x for x in (os.environ.get("NO_PROXY", ""), "127.0.0.1,localhost") if x)
    a.argv = sys.argv[1:]
    if "--result-file" in a.argv:  # the stamped command reproduces the figures, not where they went
        at = a.argv.index("--result-file")
        del a.argv[at:at + 2]
    a.device, a.device_kind = _device()
    options = dict(o.split("=", 1) for o in a.plugin_option if "=" in o)
    a.group = options.get("kvtransfer_torch.process_group", "")
    # A time limit's SIGTERM unwinds like an error, so the servers started here are stopped.
    signal.signal(signal.SIGTERM, _on_term)
    log_dir = tempfile.mkdtemp(prefix="bench-disagg-")
    begin = time.perf_counter()
    per_backend: list[float] = []
    for backend in a.backend or ["zmq"]:
        left = a.budget_s - (time.perf_counter() - begin)
        if a.budget_s and per_backend and left < max(per_backend) * 1.1:
            print(json.dumps({"kind": "skipped", "backend": backend, "left_s": round(left, 1)}), flush=True)
            continue
        t = time.perf_counter()
        earlier = set(os.listdir(log_dir))  # the logs of backends before this one were printed already
        try:
            _run_backend(a, backend, log_dir)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next backend
            print(json.dumps({"kind": "error", "backend": backend, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
            for name in sorted(set(os.listdir(log_dir)) - earlier):
                print(f"--- {name}\n{_tail(os.path.join(log_dir, name))}", flush=True)
            if isinstance(exc, TimeoutError):
                break
            continue
        per_backend.append(time.perf_counter() - t)


if __name__ == "__main__":
    main()
