"""``engine bench cpu-compare``: the engine against transformers ``generate`` and llama.cpp on one
GGUF (default: the embedded default model), in one process, on the CPU.

Each round runs the three back to back per batch size (engine, transformers, llama.cpp), and each
figure is the median over rounds, so load from other processes on a shared machine hits all three
alike; the load average is recorded with the figures.

- engine: ``bench one-batch``'s loop (``run_one``) on the scheduler the server would build;
  decode rate from its median step, TTFT from its prefill (first token sampled).
- transformers: ``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` in float32 (transformers
  dequantizes the GGUF), greedy ``generate``; TTFT is a 1-token ``generate``, the decode rate
  ``(output_len - 1)`` steps over (an ``output_len``-token ``generate`` minus the 1-token one).
- llama.cpp (``llama-cpp-python``, only where it is importable): the same GGUF file with
  ``n_threads`` = torch's thread count; one sequence (its Python API decodes one), so batch 1
  only; TTFT is the prompt's evaluation and the first sample, the rate the steps after it.

Prompts are the same random token ids for all three.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.bench.results import append_rows
from engine.config import ServerArgs

LLAMA_CPP_MISSING = "llama.cpp: not measured (llama_cpp is not importable; pip install llama-cpp-python)"


@dataclass
class Runs:
    """One contender's figures over the rounds."""

    tok_s: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)

    def median(self) -> tuple[float | None, float | None]:
        if not self.tok_s:
            return None, None
        return statistics.median(self.tok_s), statistics.median(self.ttft_ms)


def _engine(scheduler: Any, batch: int, input_len: int, output_len: int, runs: Runs) -> None:
    from engine.bench.one_batch import run_one

    res = run_one(scheduler, batch, input_len, output_len)
    runs.tok_s.append(res.median_decode_throughput)
    runs.ttft_ms.append(res.prefill_latency_s * 1e3)


def _transformers(model: Any, prompts: list[list[int]], output_len: int, runs: Runs) -> None:
    ids = torch.tensor(prompts)

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n)
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - start

    first = timed(1)
    runs.tok_s.append(len(prompts) * (output_len - 1) / (timed(output_len) - first))
    runs.ttft_ms.append(first * 1e3)


def _llama_cpp(llm: Any, prompt: list[int], output_len: int, runs: Runs) -> None:
    times = []
    llm.reset()  # otherwise generate reuses the previous round's identical prompt from its KV cache
    start = time.perf_counter()
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        times.append(time.perf_counter())
        if len(times) == output_len:
            break
    runs.ttft_ms.append((times[0] - start) * 1e3)
    runs.tok_s.append((output_len - 1) / (times[-1] - times[0]))


def load_llama_cpp(gguf_path: str, context: int, threads: int) -> Any:
    """llama.cpp's model on ``gguf_path``, or None where ``llama_cpp`` is not importable."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.Llama(model_path=gguf_path, n_ctx=context, n_batch=context, n_threads=threads,
                           n_threads_batch=threads, verbose=False)


def bench_cpu_compare(args: ServerArgs, batch_sizes: list[int], input_len: int, output_len: int,
                      rounds: int = 3, result_file: str | None = None) -> list[dict[str, Any]]:
    """Runs the comparison; prints one line per batch size and appends one row each to ``result_file``."""
    from transformers import AutoModelForCausalLM

    from engine.default_model import default_model_gguf
    from engine.entrypoints.launch import resolve_model_path
    from engine.managers.scheduler import Scheduler
    from engine.model_executor.gguf_loader import find_gguf, gguf_source

    model_path = resolve_model_path(args)
    gguf_path = (default_model_gguf() if args.model_path is None
                 else find_gguf(args.model_path) or gguf_source(args.model_path))
    if gguf_path is None:
        raise ValueError(f"--model-path: {args.model_path} is not a GGUF file (or the engine's conversion of "
                         "one); accepted: a GGUF, which all three read")
    threads = torch.get_num_threads()
    scheduler = Scheduler(args, model_path)
    quant = scheduler.runner.selection.quant_config
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                              dtype=torch.float32).eval()
    llm = load_llama_cpp(gguf_path, input_len + output_len + 8, threads)
    if llm is None:
        print(LLAMA_CPP_MISSING, flush=True)
    gen = torch.Generator().manual_seed(0)
    vocab = scheduler.runner.vocab_size
    prompts = {b: torch.randint(3, vocab, (b, input_len), generator=gen).tolist() for b in batch_sizes}
    # Warm-up, untimed: first calls allocate and pick kernels.
    _engine(scheduler, 1, 32, 4, Runs())
    _transformers(hf, [prompts[batch_sizes[0]][0][:32]], 4, Runs())
    if llm is not None:
        _llama_cpp(llm, prompts[batch_sizes[0]][0][:32], 4, Runs())
    engine_runs = {b: Runs() for b in batch_sizes}
    hf_runs = {b: Runs() for b in batch_sizes}
    llama_runs = {b: Runs() for b in batch_sizes}
    loads = []
    for _ in range(rounds):
        for b in batch_sizes:
            loads.append(os.getloadavg()[0])
            _engine(scheduler, b, input_len, output_len, engine_runs[b])
            _transformers(hf, prompts[b], output_len, hf_runs[b])
            if llm is not None and b == 1:
                _llama_cpp(llm, prompts[b][0], output_len, llama_runs[b])
    machine = (f"{os.cpu_count()} CPU cores, torch {torch.__version__}, {threads} thread"
               f"{'s' if threads > 1 else ''}")
    rows = []
    for b in batch_sizes:
        ours, theirs, llama = engine_runs[b].median(), hf_runs[b].median(), llama_runs[b].median()
        row = {"bench": "cpu-compare", "machine": machine, "model_path": args.model_path,
               "gguf": os.path.basename(gguf_path), "quant": getattr(quant, "name", None),
               "batch_size": b, "input_len": input_len, "output_len": output_len, "threads": threads,
               "rounds": rounds, "load_avg": round(statistics.median(loads), 2),
               "engine_tok_s": ours[0], "engine_ttft_ms": ours[1],
               "transformers_tok_s": theirs[0], "transformers_ttft_ms": theirs[1],
               "llama_cpp_tok_s": llama[0], "llama_cpp_ttft_ms": llama[1],
               "engine_runs": engine_runs[b].tok_s, "transformers_runs": hf_runs[b].tok_s,
               "llama_cpp_runs": llama_runs[b].tok_s}
        rows.append(row)
        print(describe(row), flush=True)
        append_rows(result_file, row)
    return rows


def describe(row: dict[str, Any]) -> str:
    """One line: the three rates and TTFTs, the ratios, the load."""
    parts = [f"batch {row['batch_size']}: engine {row['engine_tok_s']:.1f} tok/s (TTFT {row['engine_ttft_ms']:.0f} ms)",
             f"transformers {row['transformers_tok_s']:.1f} tok/s (TTFT {row['transformers_ttft_ms']:.0f} ms)"]
    if row.get("llama_cpp_tok_s"):
        parts.append(f"llama.cpp {row['llama_cpp_tok_s']:.1f} tok/s (TTFT {row['llama_cpp_ttft_ms']:.0f} ms)")
    ratios = [f"{row['engine_tok_s'] / row['transformers_tok_s']:.2f}x transformers"]
    if row.get("llama_cpp_tok_s"):
        ratios.append(f"{row['engine_tok_s'] / row['llama_cpp_tok_s']:.2f}x llama.cpp")
    return "; ".join(parts) + f"; engine {', '.join(ratios)} (load average {row['load_avg']:.1f})"
