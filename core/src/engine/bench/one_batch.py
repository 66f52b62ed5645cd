"""``engine bench one-batch``: latency of one static batch (prefill, then decode steps).

Runs the real scheduler-side path in-process (ScheduleBatch -> ForwardBatch ->
ModelRunner, CUDA graphs included) without queueing, like SGLang's bench_one_batch.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.bench.results import append_rows
from engine.config import ServerArgs
from engine.platforms import synchronize_device


@dataclass
class OneBatchResult:
    batch_size: int
    input_len: int
    output_len: int
    prefill_latency_s: float
    prefill_throughput: float  # input tokens / s
    median_decode_latency_s: float
    median_decode_throughput: float  # output tokens / s over the batch
    total_latency_s: float
    overall_throughput: float  # (input + output) tokens / s
    overlap: bool = False
    # Every request's generated ids (not written to the result file).
    output_ids: list[list[int]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "output_ids"}


def _sync(device: torch.device) -> None:
    synchronize_device(device)


def run_one(scheduler: Any, batch_size: int, input_len: int, output_len: int, seed: int = 0,
            overlap: bool | None = None, json_schema: str | None = None,
            lora_names: list[str] | None = None) -> OneBatchResult:
    """Prefill ``batch_size`` random prompts, then decode ``output_len - 1`` steps.

    With ``overlap`` (default: the scheduler's setting, on for CUDA) each decode step is
    launched before the previous step's tokens are copied to the host, as the server's
    overlapped loop does; the input of step N+1 is step N's sampled ids, still on the device.
    Without it every step waits for its tokens (SGLang's bench_one_batch measures that way).

    ``json_schema``: every request decodes under this schema, through the scheduler's own
    ``GrammarQueue`` (compiled once before timing; per step: the CPU bitmask, its copy and the
    batched apply; under overlap the previous step's tokens are accepted while the forward
    runs, as the server does). A request whose JSON completes starts a new one, so every
    step stays constrained whatever ``output_len`` is.

    ``lora_names``: loaded adapters the requests run with, round-robin (request ``i`` on
    ``lora_names[i % len]``), attached as the scheduler attaches a request's ``lora_path``.
    """
    from engine.managers.schedule_batch import Req, ScheduleBatch
    from engine.managers.scheduler_decode import InflightDecode
    from engine.sampling.sampling_batch_info import SamplingBatchInfo
    from engine.sampling.sampling_params import SamplingParams

    if overlap is None:
        overlap = bool(getattr(scheduler, "enable_overlap", False))
    runner = scheduler.runner
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.vocab_size
    reqs = []
    for i in range(batch_size):
        ids = torch.randint(0, vocab, (input_len,), generator=gen).tolist()
        req = Req(f"bench-{i}", ids, SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True), set())
        req.fill_ids = list(ids)
        req.extend_input_len = input_len
        if lora_names:
            error = scheduler._attach_lora(req, lora_names[i % len(lora_names)])
            if error:
                raise ValueError(error)
        reqs.append(req)
    grammar = scheduler.grammar_queue if json_schema is not None else None
    if grammar is not None:
        from engine.constrained import GrammarKey

        key = GrammarKey("json_schema", json_schema)
        compiled = grammar.compiler.submit(key).result()
        for req in reqs:
            req.grammar_key, req.grammar = key, grammar.compiler.matcher(compiled)
    def new_batch(rows: list[Req]) -> ScheduleBatch:
        return ScheduleBatch(rows, runner.req_to_token_pool, runner.token_to_kv_pool_allocator,
                             scheduler.tree_cache, runner.device)

    # Prefill in groups of whole prompts of at most --chunked-prefill-size tokens (one prompt at
    # least), as the scheduler would batch them; a 64 x 1024 prefill in one pass needs far more
    # activation memory than serving ever uses.
    chunk = scheduler.args.chunked_prefill_size if scheduler.args.chunked_prefill_enabled else 1 << 62
    rows_per_group = max(1, chunk // max(1, input_len))
    _sync(runner.device)
    start = time.perf_counter()
    for g in range(0, batch_size, rows_per_group):
        group = reqs[g : g + rows_per_group]
        fb = new_batch(group).prepare_for_extend()
        fb.sampling_info = SamplingBatchInfo.from_reqs(group, vocab, runner.device)
        logits = runner.forward(fb)
        if grammar is not None:
            grammar.set_mask(fb.sampling_info, group)
        _append(group, runner.sample(logits, fb).next_token_ids.tolist(), grammar)
    prefill = time.perf_counter() - start
    batch = new_batch(reqs)
    decode_lat: list[float] = []
    info = SamplingBatchInfo.from_reqs(reqs, vocab, runner.device)

    def append(step: InflightDecode) -> None:
        _append(reqs, step.token_ids(), grammar)

    inflight: InflightDecode | None = None
    for _ in range(output_len - 1):
        t = time.perf_counter()
        if inflight is None:
            fb = batch.prepare_for_decode()
        else:
            fb = batch.prepare_for_decode(lag=1, input_ids=inflight.sample.next_token_ids)
        fb.sampling_info = info
        logits = runner.forward(fb)
        if grammar is not None:
            if inflight is not None:  # the mask needs the previous token: accept it while the forward runs
                append(inflight)
                inflight = None
            grammar.set_mask(info, reqs)
        step = InflightDecode.start(reqs, runner.sample(logits, fb), info)
        if inflight is not None:
            append(inflight)  # waits for the previous step only; this one is still running
        inflight = step
        if not overlap:
            append(inflight)
            inflight = None
        decode_lat.append(time.perf_counter() - t)
    if inflight is not None:
        append(inflight)
    total = time.perf_counter() - start
    # Give the KV back so the next configuration starts from an empty pool.
    for req in reqs:
        slots = runner.req_to_token_pool.req_to_token[req.req_pool_idx, : req.seqlen - 1].long()
        runner.token_to_kv_pool_allocator.free(slots)
        runner.req_to_token_pool.free(req.req_pool_idx)
    if overlap and len(decode_lat) > 1:
        decode_lat = decode_lat[1:]  # the first launch waits for nothing
    med = statistics.median(decode_lat) if decode_lat else float("nan")
    return OneBatchResult(batch_size, input_len, output_len, prefill, batch_size * input_len / prefill, med,
                          batch_size / med if decode_lat else float("nan"), total,
                          batch_size * (input_len + output_len) / total, overlap,
                          [list(r.output_ids) for r in reqs])


def _append(reqs: list[Any], tokens: list[int], grammar: Any) -> None:
    """Appends a step's tokens; under a schema the matchers take them in one batch call first, as
    the scheduler does (``GrammarQueue.accept_tokens``)."""
    if grammar is not None:
        for token, accepted in zip(tokens, grammar.accept_tokens(reqs, tokens)):
            if not accepted:
                raise RuntimeError(f"the grammar refused token {token}: the bitmask was not applied")
    for req, token in zip(reqs, tokens):
        req.output_ids.append(token)
        if grammar is not None and req.grammar.is_terminated():  # a complete JSON value: the next one starts
            req.grammar = grammar.compiler.matcher(grammar.compiler.submit(req.grammar_key).result())


def bench_one_batch(args: ServerArgs, batch_sizes: list[int], input_lens: list[int], output_lens: list[int],
                    result_file: str | None = None, warmup: bool = True, platform: Any = None,
                    json_schema: str | None = None, lora_names: list[str] | None = None) -> list[OneBatchResult]:
    """Runs every (batch size, input, output) combination; with ``--tp-size``/``--pp-size`` above 1,
    in one process per rank, all running the same batches (rank 0 prints and records). With
    ``warmup`` each (batch size, input length) first runs once untimed (prefill and one decode step),
    so no timed prefill includes a kernel's first compile."""
    import engine.distributed as distributed
    from engine.entrypoints.launch import resolve_model_path
    from engine.managers.scheduler import Scheduler

    if args.tp_size * args.pp_size > 1 and distributed.get_placement().world_size == 1:
        return _bench_in_ranks(args, batch_sizes, input_lens, output_lens, result_file, warmup, json_schema,
                               lora_names)
    model_path = resolve_model_path(args)
    scheduler = Scheduler(args, model_path, platform)
    lead = distributed.get_placement().rank == 0
    results = []
    if warmup:
        # Every measured (batch size, input length) once first: its prefill's kernels are compiled
        # (Triton JIT-compiles each tile class and constant size on first use; a different shape may
        # pick different tiles) and its decode step captured before anything is timed.
        for bs, il in dict.fromkeys(itertools.product(batch_sizes, input_lens)):
            run_one(scheduler, bs, il, 2, json_schema=json_schema, lora_names=lora_names)
    for bs, il, ol in itertools.product(batch_sizes, input_lens, output_lens):
        res = run_one(scheduler, bs, il, ol, json_schema=json_schema, lora_names=lora_names)
        results.append(res)
        if not lead:
            continue
        print(f"batch {bs} input {il} output {ol}: prefill {res.prefill_latency_s * 1e3:.2f} ms "
              f"({res.prefill_throughput:.0f} tok/s), median decode {res.median_decode_latency_s * 1e3:.3f} ms "
              f"({res.median_decode_throughput:.1f} tok/s), total {res.total_latency_s:.2f} s"
              f"{' (overlapped decode)' if res.overlap else ''}{' (json_schema)' if json_schema else ''}"
              f"{_lora_note(lora_names, bs)}", flush=True)
        append_rows(result_file, {"bench": "one-batch", "device": scheduler.runner.platform.describe(),
                                  "attention": scheduler.runner.attention_backend_name,
                                  "cuda_graph": scheduler.runner.cuda_graph_runner is not None,
                                  "model_path": args.model_path, "quant": args.quant,
                                  "tp_size": args.tp_size, "pp_size": args.pp_size, "ep_size": args.ep_size,
                                  "json_schema": json_schema is not None, **_lora_fields(scheduler, lora_names, bs),
                                  **res.to_dict()})
    return results


def lora_rows(names: list[str] | None, batch_size: int) -> dict[str, int]:
    """The adapters a batch of ``batch_size`` rows runs with ``names`` (row ``i`` on
    ``names[i % len]``, as ``run_one`` attaches them) and each one's row count, in first-use
    order: a name given twice is one adapter, and names past the batch size run on no row."""
    return dict(Counter(names[i % len(names)] for i in range(batch_size))) if names else {}


def _lora_note(names: list[str] | None, batch_size: int) -> str:
    rows = lora_rows(names, batch_size)
    if not rows:
        return ""
    counts = sorted(set(rows.values()))
    each = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return (f" (LoRA: {len(rows)} adapter{'s' if len(rows) > 1 else ''} {', '.join(rows)}, round-robin: "
            f"{each} row{'s' if counts[-1] > 1 else ''} each)")


def _lora_fields(scheduler: Any, names: list[str] | None, batch_size: int) -> dict[str, Any]:
    """A LoRA run's row fields: the adapters the batch ran (distinct), the largest rank among them,
    the rank the device slots are sized for (``--max-lora-rank``) and the backend."""
    rows = lora_rows(names, batch_size)
    if not rows:
        return {}
    from engine.lora.adapter import startup_lora_shape

    rank, _ = startup_lora_shape({n: scheduler.args.lora_paths[n] for n in rows})
    manager = scheduler.runner.lora
    return {"lora_adapters": len(rows), "lora_names": list(rows), "lora_rank": rank,
            "lora_slot_rank": manager.max_rank, "lora_backend": getattr(manager.state.backend, "name", None)}


def _bench_in_ranks(args: ServerArgs, batch_sizes: list[int], input_lens: list[int], output_lens: list[int],
                    result_file: str | None, warmup: bool, json_schema: str | None = None,
                    lora_names: list[str] | None = None) -> list[OneBatchResult]:
    """One child process per rank (as the server starts them); returns rank 0's results."""
    from engine.distributed.ranks import init_method, node_placements
    from engine.entrypoints.child_process import ChildProcess, pipe
    from engine.errors import EngineError

    procs, readers = [], []
    try:
        for placement in node_placements(args, 0, init_method(args, 0)):
            reader, writer = pipe()
            readers.append(reader)
            procs.append(ChildProcess("engine.bench.one_batch:_rank_main",
                                      (args, batch_sizes, input_lens, output_lens,
                                       result_file if placement.rank == 0 else None, warmup, placement, writer,
                                       json_schema, lora_names),
                                      name=f"bench rank {placement.rank}"))
        while True:
            if readers[0].poll(0.5):
                status, payload = readers[0].recv()
                if status != "ok":
                    raise EngineError(payload)
                return payload
            dead = next((p for p in procs if not p.is_alive()), None)
            if dead is not None:
                raise EngineError(f"{dead.name} exited (exit code {dead.exitcode}); see its log above")
    finally:
        for proc in procs:
            proc.join(10.0)
            proc.kill()


def _rank_main(args: ServerArgs, batch_sizes: list[int], input_lens: list[int], output_lens: list[int],
               result_file: str | None, warmup: bool, placement: Any, conn: Any, json_schema: str | None = None,
               lora_names: list[str] | None = None) -> None:
    from engine.managers.process_utils import setup_child_logging
    from engine.managers.scheduler_process import join_replica

    setup_child_logging(args.log_level, f"bench r{placement.rank}")
    try:
        platform = join_replica(args, placement)
        results = bench_one_batch(args, batch_sizes, input_lens, output_lens, result_file, warmup, platform,
                                  json_schema, lora_names)
    except Exception as exc:
        conn.send(("error", f"rank {placement.rank}: {type(exc).__name__}: {exc}"))
        raise
    conn.send(("ok", results))
