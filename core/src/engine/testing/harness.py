"""Driving a Scheduler in-process (no ZeroMQ) for tests and benchmarks."""

from __future__ import annotations

import itertools
from typing import Any

from engine.config import ServerArgs
from engine.managers.io_struct import BatchEmbeddingOut, TokenizedEmbeddingReqInput, TokenizedGenerateReqInput

_rids = itertools.count()


def make_scheduler(model_path: str, **kwargs: Any) -> Any:
    from engine.managers.scheduler import Scheduler

    defaults: dict[str, Any] = {"model_path": model_path, "platform": "cpu", "max_total_tokens": 8192}
    defaults.update(kwargs)
    return Scheduler(ServerArgs.from_dict(defaults), model_path)


def submit(scheduler: Any, input_ids: list[int], sampling_params: dict[str, Any] | None = None, **kw: Any) -> str:
    rid = kw.pop("rid", None) or f"req-{next(_rids)}"
    scheduler.add_request(TokenizedGenerateReqInput(rid=rid, input_ids=list(input_ids),
                                                    sampling_params=dict(sampling_params or {}), **kw))
    return rid


def embed_prompts(scheduler: Any, prompts: list[list[int]], dimensions: int | None = None,
                  token_type_ids: list[list[int] | None] | None = None) -> list[dict[str, Any]]:
    """Runs pooling requests (a scheduler of ``--task embed|score``) to completion, all at once;
    ``token_type_ids``: per prompt, its segment ids (a cross-encoder's text pair) or None.

    Returns per prompt ``{"embedding": [floats] | None, "error": dict | None, "prompt_tokens",
    "cached_tokens"}`` in prompt order.
    """
    rids = []
    for i, ids in enumerate(prompts):
        rid = f"emb-{next(_rids)}"
        types = token_type_ids[i] if token_type_ids else None
        scheduler.add_embedding_request(TokenizedEmbeddingReqInput(rid=rid, input_ids=list(ids), dimensions=dimensions,
                                                                   token_type_ids=types))
        rids.append(rid)
    results: dict[str, dict[str, Any]] = {}

    def collect() -> None:
        for msg in scheduler.take_outputs():
            assert isinstance(msg, BatchEmbeddingOut), f"a pooling request produced {type(msg).__name__}"
            for i, rid in enumerate(msg.rids):
                results[rid] = {"embedding": msg.embeddings[i], "error": msg.errors[i],
                                "prompt_tokens": msg.prompt_tokens[i], "cached_tokens": msg.cached_tokens[i]}

    while scheduler.step():
        collect()
    collect()
    return [results[r] for r in rids]


class OutputCollector:
    """Accumulates BatchTokenIDOut messages per request id."""

    def __init__(self) -> None:
        self.ids: dict[str, list[int]] = {}
        self.finish: dict[str, Any] = {}
        self.meta: dict[str, dict[str, Any]] = {}

    def collect(self, scheduler: Any) -> None:
        for msg in scheduler.take_outputs():
            for i, rid in enumerate(msg.rids):
                self.ids.setdefault(rid, []).extend(msg.new_token_ids[i])
                self.meta[rid] = {"prompt_tokens": msg.prompt_tokens[i],
                                  "completion_tokens": msg.completion_tokens[i],
                                  "cached_tokens": msg.cached_tokens[i]}
                if msg.finished_reasons[i] is not None:
                    self.finish[rid] = msg.finished_reasons[i]


def generate_greedy(scheduler: Any, prompts: list[list[int]], max_new_tokens: int, **params: Any) -> list[list[int]]:
    """Runs all prompts at once to completion; returns each one's output ids."""
    sp = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **params}
    rids = [submit(scheduler, p, sp) for p in prompts]
    col = OutputCollector()
    while scheduler.step():
        col.collect(scheduler)
    col.collect(scheduler)
    return [col.ids.get(r, []) for r in rids]


def last_position_logits(scheduler: Any, prompts: list[list[int]]) -> Any:
    """One EXTEND forward over all prompts (no cache, no sampling): float32 logits at each
    prompt's last position, on the CPU."""
    from engine.model_executor.forward_batch import ForwardBatch, ForwardMode

    runner = scheduler.runner
    lens = [len(p) for p in prompts]
    slots = runner.req_to_token_pool.alloc(len(prompts))
    loc = runner.token_to_kv_pool_allocator.alloc_extend([0] * len(lens), lens, [-1] * len(lens))
    offset = 0
    for slot, n in zip(slots, lens):
        runner.req_to_token_pool.write(slot, 0, loc[offset : offset + n])
        offset += n
    batch = ForwardBatch.build(ForwardMode.EXTEND, [t for p in prompts for t in p], slots, lens,
                               [0] * len(lens), loc, runner.device)
    return runner.forward(batch).next_token_logits.float().cpu()


def assert_equal_up_to_near_ties(scheduler: Any, prompts: list[list[int]], expected: list[list[int]],
                                  got: list[list[int]], max_gap: float = 0.25) -> None:
    """Greedy outputs of two runs in half precision (speculation on vs off): equal, or equal up to
    a position where the two runs chose different tokens whose logits (one EXTEND forward of the
    common prefix on ``scheduler``) differ by at most ``max_gap``: a near-tie that an extend
    forward breaks differently from a decode step, not a wrong token. In float32 the runs are
    compared for equality instead (docs/speculative_internals.md, "Exactness and floating point")."""
    for i, (prompt, e, g) in enumerate(zip(prompts, expected, got)):
        if e == g:
            continue
        j = next((j for j, (a, b) in enumerate(zip(e, g)) if a != b), None)
        assert j is not None, f"prompt {i}: one output is a prefix of the other ({len(e)} vs {len(g)} tokens)"
        logits = last_position_logits(scheduler, [prompt + e[:j]])[0]
        gap = abs(float(logits[e[j]] - logits[g[j]]))
        assert gap <= max_gap, (f"prompt {i}: first difference at token {j} ({e[j]} vs {g[j]}) is not a near-tie: "
                                f"their logits differ by {gap:.4f} > {max_gap}")


def assert_cosine_close(logits: Any, reference: Any, min_cosine: float) -> None:
    """Every row of ``logits`` points the way ``reference``'s does (quantized vs full precision)."""
    import torch

    cosine = torch.nn.functional.cosine_similarity(logits, reference, dim=-1)
    assert bool((cosine > min_cosine).all()), f"cosine similarity per prompt: {cosine.tolist()}"


def assert_generates(path: str, prompts: list[list[int]], max_new_tokens: int, **server_args: Any) -> None:
    """A scheduler on ``path`` decodes ``max_new_tokens`` for every prompt (EOS ignored)."""
    outputs = generate_greedy(make_scheduler(path, **server_args), prompts, max_new_tokens, ignore_eos=True)
    assert [len(o) for o in outputs] == [max_new_tokens] * len(prompts)


def cuda_attention_backends() -> list[Any]:
    """``triton`` and ``flashinfer`` as pytest parameters, flashinfer skipped where not installed."""
    import importlib.util

    import pytest

    skip = [] if importlib.util.find_spec("flashinfer") else [pytest.mark.skip(reason="flashinfer is not installed")]
    return ["triton", pytest.param("flashinfer", marks=skip)]


class _StandInReq:
    """What ``SamplingBatchInfo.from_reqs`` reads of a request: its sampling parameters, and no
    output, logprobs or grammar yet."""

    def __init__(self, params: dict[str, Any]) -> None:
        from engine.sampling.sampling_params import SamplingParams

        self.sampling_params = SamplingParams.from_dict(dict(params))
        self.output_ids: list[int] = []
        self.return_logprob = False
        self.top_logprobs_num = 0
        self.origin_input_ids = [0]
        self.grammar = None


def sampling_info(params: list[dict[str, Any]], vocab: int) -> Any:
    """A CPU ``SamplingBatchInfo`` of one row per entry of ``params`` (sampling parameters as a
    request gives them), for tests of the sampler and of speculative verification."""
    import torch

    from engine.sampling.sampling_batch_info import SamplingBatchInfo

    return SamplingBatchInfo.from_reqs([_StandInReq(p) for p in params], vocab, torch.device("cpu"))
