"""Decode speed of the embedded default model (SmolLM2-135M-Instruct) on the CPU: the engine's
``bench one-batch`` loop against transformers ``generate`` on the same weights, in one process.

Both run float32 on the same converted checkpoint. The engine's figure is its median decode step;
transformers' is (generate N tokens - generate 1 token) / (N - 1) steps, i.e. its decode steps
without the prefill. Runs alternate engine / transformers per batch size and repeat, and each
figure is the median over repeats, so load from other processes hits both alike.
usage: python benchmarks/bench_default_model_cpu.py [--batch-size "1 8"] [--input-len 128]
       [--output-len 64] [--repeats 3] [--result-file F]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch


def hf_decode_tok_s(model: torch.nn.Module, batch: int, input_len: int, output_len: int, vocab: int) -> float:
    ids = torch.randint(3, vocab, (batch, input_len))

    def timed(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n)
        assert out.shape[1] == input_len + n
        return time.perf_counter() - t

    prefill = timed(1)
    return batch * (output_len - 1) / (timed(output_len) - prefill)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", default="1 8")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from engine.bench.one_batch import run_one
    from engine.bench.results import append_rows
    from engine.config import ServerArgs
    from engine.managers.scheduler import Scheduler
    from engine.model_executor.checkpoint import resolve_checkpoint

    path = resolve_checkpoint(None)
    args = ServerArgs.from_dict({"platform": "cpu", "max_total_tokens": 16384, "dtype": "float32"})
    scheduler = Scheduler(args, path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    run_one(scheduler, 1, 32, 4)  # warm-up, as engine bench one-batch does
    hf_decode_tok_s(hf, 1, 32, 4, vocab)
    sizes = [int(b) for b in a.batch_size.split()]
    engine_runs: dict[int, list[float]] = {b: [] for b in sizes}
    hf_runs: dict[int, list[float]] = {b: [] for b in sizes}
    for _ in range(a.repeats):
        for b in sizes:
            engine_runs[b].append(run_one(scheduler, b, a.input_len, a.output_len).median_decode_throughput)
            hf_runs[b].append(hf_decode_tok_s(hf, b, a.input_len, a.output_len, vocab))
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, " \
              f"{torch.get_num_threads()} threads"
    print(f"SmolLM2-135M-Instruct float32 on the CPU ({machine}); input {a.input_len}, output {a.output_len}, "
          f"median of {a.repeats}")
    for b in sizes:
        ours, ref = statistics.median(engine_runs[b]), statistics.median(hf_runs[b])
        print(f"batch {b}: engine {ours:.1f} tok/s, transformers generate {ref:.1f} tok/s, ratio {ours / ref:.2f}"
              f"  (runs: engine {', '.join(f'{x:.1f}' for x in engine_runs[b])}; "
              f"transformers {', '.join(f'{x:.1f}' for x in hf_runs[b])})", flush=True)
        append_rows(a.result_file, {"bench": "default-model-cpu-decode", "machine": machine, "batch_size": b,
                                    "input_len": a.input_len, "output_len": a.output_len,
                                    "engine_tok_s": ours, "transformers_tok_s": ref,
                                    "engine_runs": engine_runs[b], "transformers_runs": hf_runs[b]})


if __name__ == "__main__":
    main()
