"""``engine bench spec``: decode speed on a copy-heavy request, with the speculation the flags set.

A chat asks the model to repeat a long passage of its prompt word for word (the workload
prompt-lookup speculation is for). The request runs through the real scheduler in-process
(admission, prefill, decode or speculative decode steps), greedy, to ``--output-len`` tokens;
the figure is output tokens per second of decode wall time, with the mean acceptance length
(tokens per request and verify step) when speculation is on. Run it with and without
``--speculative-algorithm`` to compare; the outputs' equality is checked by the tests, and the
result line carries a hash of the output ids so two runs can be compared.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from engine.config import ServerArgs

#: Original prose (no dataset download): the passage the request quotes back.
PASSAGE = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every evening the "
    "keeper climbed the narrow stairs, cleaned the great lens, and lit the lamp before the sun went down. "
    "Ships that passed in the night saw the beam sweep across the water and knew where the rocks were hidden. "
    "When the storms came in winter, the waves rose higher than the houses in the village below, and the "
    "keeper stayed awake until morning, watching the light turn and listening to the wind. In spring the "
    "fishermen painted their boats in bright colours, mended their nets on the harbour wall, and told stories "
    "about the winters they had survived. Children ran along the beach looking for shells and pieces of "
    "green glass worn smooth by the sea. The keeper's daughter learned to read the weather from the shape of "
    "the clouds and the colour of the water, and she wrote everything down in a small notebook with a blue "
    "cover. Years later, when the light was finally replaced by an automatic lamp, she gave the notebook to "
    "the village school, where it is still kept in a glass case beside the window that looks out to sea."
)


def _prompt_ids(model_path: str, passages: int) -> list[int]:
    from transformers import AutoTokenizer

    from engine.testing.default_model import chat_prompt_ids

    tok: Any = AutoTokenizer.from_pretrained(model_path)
    text = "\n\n".join([PASSAGE] * passages)
    chat = [{"role": "user", "content": f"Repeat the following text exactly, word for word, and add nothing:\n\n{text}"}]
    return chat_prompt_ids(tok, chat)


def _run(scheduler: Any, prompts: list[list[int]], output_len: int) -> tuple[list[list[int]], float]:
    from engine.testing.harness import OutputCollector, submit

    rids = [submit(scheduler, p, {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True})
            for p in prompts]
    col = OutputCollector()
    before = scheduler.decode_time_s
    while scheduler.step():
        col.collect(scheduler)
    col.collect(scheduler)
    return [col.ids.get(r, []) for r in rids], scheduler.decode_time_s - before


def bench_spec(args: ServerArgs, batch_size: int, output_len: int, passages: int,
               result_file: str | None = None) -> dict[str, Any]:
    """Runs the copy request ``batch_size`` times at once; prints and returns the figures."""
    from engine.entrypoints.launch import resolve_model_path
    from engine.managers.scheduler import Scheduler

    model_path = resolve_model_path(args)
    scheduler = Scheduler(args, model_path)
    prompt = _prompt_ids(args.tokenizer_path or model_path, passages)
    _run(scheduler, [prompt], 8)  # warm-up: kernels compiled, the prompt's prefix cached
    spec = scheduler.speculator
    base = spec.stats.__dict__.copy() if spec is not None else {}
    started = time.perf_counter()
    outputs, decode_s = _run(scheduler, [prompt] * batch_size, output_len)
    total_s = time.perf_counter() - started
    decode_tokens = sum(max(len(o) - 1, 0) for o in outputs)  # the first token comes from the prefill
    result: dict[str, Any] = {
        "bench": "spec", "device": scheduler.runner.platform.describe(),
        "attention": scheduler.runner.attention_backend_name, "algorithm": args.speculative_algorithm,
        "num_draft_tokens": spec.num_draft_tokens if spec is not None else 1,
        "batch_size": batch_size, "prompt_tokens": len(prompt), "output_len": output_len,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0, "decode_s": decode_s,
        "total_s": total_s, "cuda_graph": scheduler.runner.cuda_graph_runner is not None,
        "outputs_sha1": hashlib.sha1(json.dumps(outputs).encode()).hexdigest()[:12],
    }
    if spec is not None:
        now = spec.stats.__dict__
        rows = now["verified_rows"] - base["verified_rows"]
        emitted = now["emitted_tokens"] - base["emitted_tokens"]
        result.update(mean_accept_length=emitted / rows if rows else 0.0,
                      verify_steps=now["verify_steps"] - base["verify_steps"],
                      fallback_steps=now["fallback_steps"] - base["fallback_steps"])
    print(f"spec {args.speculative_algorithm or 'off'}: batch {batch_size}, prompt {len(prompt)} tokens, "
          f"{decode_tokens} decode tokens in {decode_s:.3f} s = {result['decode_tokens_per_s']:.1f} tok/s"
          + (f", mean acceptance length {result['mean_accept_length']:.2f}" if spec is not None else "")
          + f", outputs {result['outputs_sha1']}", flush=True)
    if result_file:
        with open(result_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
    return result
