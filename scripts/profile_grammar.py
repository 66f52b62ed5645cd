"""Where a constrained decode step's time goes (structured output, issue 13).

1. The grammar library's host work for a batch: bitmask fill (matcher by matcher, and xgrammar's
   threaded batch fill at several thread counts) and token acceptance, per step (the old per-row
   ``accept_token`` loop, and the backend's batch ``accept_tokens`` at several ``accept_threads``,
   replaying the same recorded tokens).
2. ``engine bench one-batch``'s decode loop with and without the JSON schema under cProfile: the
   functions that take the host's time (a device wait shows up as time in the call that syncs).

usage: python scripts/profile_grammar.py MODEL_DIR [--batch-size 64] [--steps 60] [--attention triton]
MODEL_DIR needs a tokenizer (device_bench.sh's .cache/bench_grammar); weights are dummy.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time

import torch


def library_host_work(model_dir: str, vocab: int, batch: int, steps: int) -> None:
    """Bitmask fill, then token acceptance, of ``batch`` rows under the benchmark schema, through
    the engine's xgrammar backend (its default options; fill_threads as listed): what the
    scheduler calls each step, padded vocabulary handling included."""
    from transformers import AutoTokenizer

    from engine.bench.json_schema import BENCH_SCHEMA
    from engine.constrained import GrammarKey, TokenizerInfo, allocate_bitmask
    from engine_grammar_xgrammar.backend import XGrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    info = TokenizerInfo(tokenizer, vocab, tuple(t for t in [tokenizer.eos_token_id] if t is not None), model_dir)
    compiled = XGrammarBackend(info).compile(GrammarKey("json_schema", json.dumps(BENCH_SCHEMA)))
    gen = torch.Generator().manual_seed(0)
    modes = [("serial", 1)] + [("batch", t) for t in (2, 4, 8) if t <= (os.cpu_count() or 1)]
    recorded: list[list[int]] = []  # the serial run's tokens, replayed by the acceptance modes
    rows = list(range(batch))
    for mode, threads in modes:
        backend = XGrammarBackend(info, options={"fill_threads": threads})
        backend.compiler  # noqa: B018  (built, as the engine's is before any matcher)
        matchers = [backend.matcher(compiled) for _ in range(batch)]
        bitmask = allocate_bitmask(batch, vocab)
        fill = 0.0
        for _ in range(steps):
            t = time.perf_counter()
            backend.fill_bitmasks(matchers, bitmask, rows)
            fill += time.perf_counter() - t
            logits = torch.randn(batch, vocab, generator=gen)
            backend.apply_bitmask(logits, bitmask)
            ids = logits.argmax(-1).tolist()
            if mode == "serial":
                recorded.append(ids)
            assert all(backend.accept_tokens(matchers, ids))
            for i, m in enumerate(matchers):
                if m.is_terminated():
                    matchers[i] = backend.matcher(compiled)
        print(f"xgrammar {mode} fill threads={threads}: fill {fill / steps * 1e3:.3f} ms/step, batch {batch}")
    accept_host_work(info, compiled, recorded)


def accept_host_work(info: object, compiled: object, recorded: list[list[int]]) -> None:
    """Acceptance of the recorded steps: the old per-row loop of ``accept_token``, and the xgrammar
    backend's ``accept_tokens`` (what the scheduler calls once per step) at several thread counts."""
    from engine_grammar_xgrammar.backend import XGrammarBackend

    batch, steps = len(recorded[0]), len(recorded)
    modes = [("per-row accept_token loop", 1)] + [
        (f"backend accept_tokens accept_threads={t}", t) for t in (1, 2, 4, 8) if t <= (os.cpu_count() or 1)]
    for name, threads in modes:
        backend = XGrammarBackend(info, options={"accept_threads": threads})  # type: ignore[arg-type]
        matchers = [backend.matcher(compiled) for _ in range(batch)]
        took = 0.0
        for ids in recorded:
            t = time.perf_counter()
            if name.startswith("per-row"):
                accepted = [m.accept_token(tok) for m, tok in zip(matchers, ids)]
            else:
                accepted = backend.accept_tokens(matchers, ids)
            took += time.perf_counter() - t
            assert all(accepted)
            for i, m in enumerate(matchers):
                if m.is_terminated():
                    matchers[i] = backend.matcher(compiled)
        print(f"xgrammar accept, {name}: {took / steps * 1e3:.3f} ms/step, batch {batch}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--attention", default=None, help="attention plugin (default: the platform's)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    from engine.bench.json_schema import BENCH_SCHEMA
    from engine.bench.one_batch import run_one
    from engine.config import ServerArgs
    from engine.managers.scheduler import Scheduler

    args = ServerArgs.from_dict({"model_path": a.model_dir, "load_format": "dummy", "attention": a.attention})
    sched = Scheduler(args, a.model_dir)
    library_host_work(a.model_dir, sched.runner.vocab_size, a.batch_size, a.steps)
    schema = json.dumps(BENCH_SCHEMA)
    for js in (None, schema):
        run_one(sched, a.batch_size, 128, 8, json_schema=js)  # warm: graphs, kernels, the compiled grammar
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        res = run_one(sched, a.batch_size, 128, a.steps + 1, json_schema=js)
        prof.disable()
        wall = time.perf_counter() - t
        print(f"\n=== {'json_schema' if js else 'unconstrained'}: batch {a.batch_size}, {a.steps} decode steps, "
              f"median step {res.median_decode_latency_s * 1e3:.3f} ms, wall {wall:.2f} s (cProfile on)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
