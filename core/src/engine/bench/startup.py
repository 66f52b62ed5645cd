"""``engine bench startup``: seconds to the first answer, against the import floor.

The floor is what any Python program serving this model pays before its first token: a fresh
interpreter importing torch and transformers and loading the tokenizer. Each figure is a fresh
process timed from its launch, so rounds can alternate (floor, generate, serve) and their ratios
compare numbers taken under the same load on a shared machine.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from engine.config import ServerArgs
from engine.ports import free_port

_FLOOR = ("import sys, torch, transformers\n"
          "from transformers import AutoTokenizer\n"
          "AutoTokenizer.from_pretrained(sys.argv[1])\n")

# Prints one line the moment the first answer exists; shutdown is not timed.
_GENERATE = ("import json, sys\n"
             "from engine import Engine\n"
             "engine = Engine(**json.loads(sys.argv[1]))\n"
             "out = engine.generate('Hello', {'max_new_tokens': 1})\n"
             "print('answered', out['meta_info']['completion_tokens'], flush=True)\n"
             "engine.shutdown()\n")

_SERVED_NAME = "startup-bench"


@dataclass
class StartupResult:
    model_path: str
    floor_s: list[float] = field(default_factory=list)
    generate_s: list[float] = field(default_factory=list)
    serve_s: list[float] = field(default_factory=list)
    # CPU seconds (user + system) of each whole run, its processes' and their children's, shutdown
    # included: what a start costs a shared machine (or a test suite) beside its wall time.
    generate_cpu_s: list[float] = field(default_factory=list)
    serve_cpu_s: list[float] = field(default_factory=list)

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(values) for name, values in
                (("floor_s", self.floor_s), ("generate_s", self.generate_s), ("serve_s", self.serve_s)) if values}

    def to_dict(self) -> dict[str, Any]:
        medians = self.medians()
        floor = medians.get("floor_s")
        ratios = {f"{k[:-2]}_ratio": round(v / floor, 2) for k, v in medians.items() if floor and k != "floor_s"}
        cpu = {name: round(statistics.median(values), 2) for name, values in
               (("generate_cpu_s", self.generate_cpu_s), ("serve_cpu_s", self.serve_cpu_s)) if values}
        return {"model_path": self.model_path, **{k: round(v, 2) for k, v in medians.items()}, **ratios, **cpu,
                "runs": {"floor_s": self.floor_s, "generate_s": self.generate_s, "serve_s": self.serve_s,
                         "generate_cpu_s": self.generate_cpu_s, "serve_cpu_s": self.serve_cpu_s}}


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's reaped children (and theirs) so far."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run_until(cmd: list[str], marker: str | None, timeout: float) -> float:
    """Seconds from launch until ``marker`` on stdout (or a clean exit when None)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if marker is None:
            _, err = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"{cmd[:3]} failed (exit {proc.returncode}): {err[-2000:]}")
            return time.perf_counter() - start
        for line in proc.stdout:
            if line.startswith(marker):
                return time.perf_counter() - start
        proc.wait(timeout)
        raise RuntimeError(f"no answer (exit {proc.returncode}): {proc.stderr.read()[-2000:] if proc.stderr else ''}")
    finally:
        if proc.poll() is None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _serve_seconds(overrides: dict[str, Any], timeout: float) -> float:
    """Seconds from ``engine serve``'s launch to a 200 answer to a one-token completion."""
    port = free_port()
    cmd = [sys.executable, "-m", "engine", "serve", "--port", str(port), "--served-model-name", _SERVED_NAME]
    for key, value in overrides.items():
        flag = f"--{key.replace('_', '-')}"
        cmd += ([flag] if value else []) if isinstance(value, bool) else [flag, str(value)]
    body = json.dumps({"model": _SERVED_NAME, "prompt": "Hello", "max_tokens": 1}).encode()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"engine serve exited (code {proc.returncode}): {proc.stderr.read()[-2000:] if proc.stderr else ''}")
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    if resp.status == 200:
                        return time.perf_counter() - start
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.02)  # not listening yet
        raise RuntimeError(f"engine serve gave no answer within {timeout:.0f} s")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench_startup(args: ServerArgs, rounds: int, modes: list[str], timeout: float = 600.0) -> StartupResult:
    """Alternates floor / generate / serve for ``rounds`` rounds; prints each run and the medians."""
    from engine.entrypoints.launch import resolve_model_path

    model_path = resolve_model_path(args)  # builds/converts the default model once, untimed
    tokenizer_dir = args.tokenizer_path or model_path
    defaults = ServerArgs()
    overrides = {k: v for k, v in args.to_dict().items() if v != getattr(defaults, k, None)}
    overrides.setdefault("model_path", model_path)
    overrides.pop("port", None)
    result = StartupResult(model_path)
    for i in range(rounds):
        result.floor_s.append(_run_until([sys.executable, "-c", _FLOOR, tokenizer_dir], None, timeout))
        print(f"round {i + 1}: import floor {result.floor_s[-1]:.2f} s", flush=True)
        if "generate" in modes:
            cpu = _children_cpu_s()
            result.generate_s.append(_run_until([sys.executable, "-c", _GENERATE, json.dumps(overrides)],
                                                "answered", timeout))
            result.generate_cpu_s.append(round(_children_cpu_s() - cpu, 2))
            print(f"round {i + 1}: Engine first answer {result.generate_s[-1]:.2f} s "
                  f"({result.generate_cpu_s[-1]:.2f} CPU-s)", flush=True)
        if "serve" in modes:
            cpu = _children_cpu_s()
            result.serve_s.append(_serve_seconds({k: v for k, v in overrides.items() if _cli_value(v)}, timeout))
            result.serve_cpu_s.append(round(_children_cpu_s() - cpu, 2))
            print(f"round {i + 1}: engine serve first answer {result.serve_s[-1]:.2f} s "
                  f"({result.serve_cpu_s[-1]:.2f} CPU-s)", flush=True)
    return result


def _cli_value(value: Any) -> bool:
    """Overrides a flag can carry (lists and plugin options go by --config instead)."""
    return isinstance(value, (str, int, float, bool))


def format_summary(result: StartupResult) -> str:
    data = result.to_dict()
    lines = [f"model: {result.model_path} ({os.cpu_count()} cores; medians of {len(result.floor_s)} round(s))",
             f"import floor (import torch, transformers + tokenizer): {data['floor_s']:.2f} s"]
    for key, label in (("generate", "Engine: first answer"), ("serve", "engine serve: first answer")):
        if f"{key}_s" in data:
            cpu = f", {data[f'{key}_cpu_s']:.2f} CPU-s a run" if f"{key}_cpu_s" in data else ""
            lines.append(f"{label}: {data[f'{key}_s']:.2f} s = {data[f'{key}_ratio']:.2f}x the floor{cpu}")
    return "\n".join(lines)
