"""Tensor and pipeline parallelism on the CPU (gloo, one process per rank): greedy outputs equal
transformers', and the pipeline-parallel scheduler (several micro-batches in flight) equals one rank.

A rank is a process whose start costs far more than these checks, so each layout's one engine runs
all of them:

- Parity: three prompts against transformers, then the first again from the prefix cache (on
  every rank alike) with logprobs. The checkpoint exercises the awkward cases at once: 1 KV head
  (replicated on both tensor-parallel ranks), an odd vocabulary (2051 rows: padded to a multiple of
  the TP size) and tied embeddings (split from the LM head across pipeline stages).
- One scenario against one rank's outputs: prompts longer than the prefill chunk (chunked
  prefill), requests arriving while others decode (prefill and decode micro-batches interleave),
  different lengths (requests finish while others are in flight), a streaming request aborted
  after a few tokens, and prompt/output logprobs. Under pipeline parallelism the micro-batch
  counters must show more than one micro-batch in flight; nothing may stay allocated afterwards.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from engine import Engine
from engine.errors import EngineError
from engine.managers.tokenizer_manager import GenerateRequest
from engine.testing.checkpoints import hf_greedy, load_hf_model, make_tiny_checkpoint

MAX_NEW = 8
CHUNK = 16
POOL = 1024


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tp-llama")), "LlamaForCausalLM",
                                vocab_size=2051, num_key_value_heads=1, tie_word_embeddings=True,
                                num_hidden_layers=3)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 2048) for _ in range(n)] for n in (3, 17, 9)]


@pytest.fixture(scope="module")
def expected(ckpt: str, prompts: list[list[int]]) -> list[list[int]]:
    model = load_hf_model(ckpt)
    return [hf_greedy(model, p, MAX_NEW) for p in prompts]


def _requests() -> tuple[list[GenerateRequest], list[GenerateRequest]]:
    rng = random.Random(7)
    first, later = [], []
    for i, (n, new) in enumerate([(5, 12), (40, 20), (9, 3), (23, 15), (3, 24), (18, 1)]):
        first.append(GenerateRequest(input_ids=[rng.randrange(4, 1000) for _ in range(n)], rid=f"a{i}",
                                     sampling_params={"max_new_tokens": new, "temperature": 0},
                                     return_logprob=i == 1, logprob_start_len=0, top_logprobs_num=2 if i == 1 else 0))
    for i, (n, new) in enumerate([(30, 10), (7, 16), (12, 6)]):
        later.append(GenerateRequest(input_ids=[rng.randrange(4, 1000) for _ in range(n)], rid=f"b{i}",
                                     sampling_params={"max_new_tokens": new, "temperature": 0}))
    return first, later


async def _scenario(eng: Engine) -> tuple[dict[str, Any], dict[str, Any]]:
    manager = eng.tokenizer_manager

    async def run(req: GenerateRequest) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async for out in manager.generate(req):
            pass
        return out

    first, later = _requests()
    tasks = [asyncio.ensure_future(run(r)) for r in first]
    victim = GenerateRequest(input_ids=[11, 12, 13, 14], rid="victim", stream=True,
                             sampling_params={"max_new_tokens": 200, "temperature": 0, "ignore_eos": True})
    seen, aborted = 0, False
    async for out in manager.generate(victim):
        seen = len(out["output_ids"])
        if seen >= 2 and not aborted:
            aborted = True
            # The others decode meanwhile; more requests arrive, and the victim is aborted
            # while its next micro-batch may be in flight.
            tasks += [asyncio.ensure_future(run(r)) for r in later]
            manager.abort("victim")
        if seen >= 2 and out["meta_info"].get("finish_reason"):
            break
    results = await asyncio.gather(*tasks)
    return {o["meta_info"]["id"]: o for o in results}, out


def _run(ckpt: str, prompts: list[list[int]], **kw: Any) -> dict[str, Any]:
    """The scenario, then the parity prompts (twice: the second round hits the prefix cache)."""
    greedy = {"max_new_tokens": MAX_NEW, "temperature": 0}
    with Engine(model_path=ckpt, max_total_tokens=POOL, chunked_prefill_size=CHUNK, log_level="warning",
                **kw) as eng:
        outs, victim = eng.loop.run_until_complete(_scenario(eng))
        parity = eng.generate(input_ids=prompts, sampling_params=greedy)
        again = eng.generate(input_ids=prompts[:1], sampling_params=greedy, return_logprob=True)
        info = eng.get_server_info()
    assert again[0]["output_ids"] == parity[0]["output_ids"]
    assert len(again[0]["meta_info"]["output_token_logprobs"]) == MAX_NEW
    assert info["max_total_num_tokens"] == POOL
    # No KV left held by a request (the prefix cache may keep what it cached).
    assert info["kv_used_tokens"] == 0 and info["num_running_reqs"] == 0
    return {"outs": outs, "victim": victim, "parity": [o["output_ids"] for o in parity], "info": info}


@pytest.fixture(scope="module")
def reference(ckpt: str, prompts: list[list[int]], expected: list[list[int]]) -> dict[str, Any]:
    one_rank = _run(ckpt, prompts)
    assert one_rank["parity"] == expected
    return one_rank["outs"]


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (1, 3), (2, 2)], ids=["tp2", "pp2", "pp3", "tp2xpp2"])
def test_layout_equals_transformers_and_one_rank(ckpt: str, prompts: list[list[int]], expected: list[list[int]],
                                                 reference: dict[str, Any], tp: int, pp: int) -> None:
    run = _run(ckpt, prompts, tp_size=tp, pp_size=pp)
    assert run["parity"] == expected
    outs, victim, info = run["outs"], run["victim"], run["info"]
    assert sorted(outs) == sorted(reference)
    for key, ref in reference.items():
        got = outs[key]
        assert got["output_ids"] == ref["output_ids"], key
        assert got["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"], key
        if "output_token_logprobs" in ref["meta_info"]:
            for a, b in zip(got["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_token_logprobs"]):
                assert a[1] == b[1] and a[0] == pytest.approx(b[0], abs=1e-3)
            got_in, ref_in = got["meta_info"]["input_token_logprobs"], ref["meta_info"]["input_token_logprobs"]
            assert len(got_in) == len(ref_in) == 40  # scored across the chunks of the prefill
            assert [a[1] for a in got_in] == [b[1] for b in ref_in]
            assert [a[0] for a in got_in[1:]] == pytest.approx([b[0] for b in ref_in[1:]], abs=1e-3)
    assert victim["meta_info"]["finish_reason"]["type"] == "abort"
    assert 2 <= len(victim["output_ids"]) < 200
    if pp > 1:
        # Several micro-batches were in the pipeline at once, and every one was processed.
        assert info["pp_max_in_flight"] == pp
        assert info["pp_overlapped_micro_batches"] > 1
        assert info["pp_in_flight_micro_batches"] == 0
        assert info["pp_micro_batches"] == info["forward_steps"]


def test_kv_pressure_retracts_and_still_equals_one_rank(ckpt: str) -> None:
    """A pool too small for every request at once: decode micro-batches wait for those in flight,
    then requests are retracted and recomputed; outputs stay those of one rank (in-process, with
    room for all)."""
    from engine.testing.harness import generate_greedy, make_scheduler

    rng = random.Random(3)
    prompts = [[rng.randrange(4, 1000) for _ in range(20)] for _ in range(6)]
    with Engine(model_path=ckpt, max_total_tokens=100, log_level="warning", pp_size=2) as eng:
        got = [o["output_ids"] for o in eng.generate(input_ids=prompts,
                                                     sampling_params={"max_new_tokens": 40, "temperature": 0})]
        info = eng.get_server_info()
    assert got == generate_greedy(make_scheduler(ckpt, max_total_tokens=POOL), prompts, 40)
    assert info["num_retractions"] > 0 and info["pp_max_in_flight"] == 2
    assert info["kv_used_tokens"] == 0


def test_tp_size_that_does_not_divide_heads_is_refused(ckpt: str) -> None:
    with pytest.raises(EngineError, match=r"--tp-size: invalid value 3 for this model \(4 attention heads.*accepted: 1, 2, 4"):
        Engine(model_path=ckpt, tp_size=3, max_total_tokens=512, log_level="warning")


def test_pp_size_above_layers_is_refused(ckpt: str) -> None:
    with pytest.raises(EngineError, match=r"--pp-size: invalid value 4; accepted: at most the model's 3 layers"):
        Engine(model_path=ckpt, pp_size=4, max_total_tokens=512, log_level="warning")


def test_other_nodes_run_only_through_engine_serve(ckpt: str) -> None:
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--node-rank: invalid value 1 here; .*engine serve --node-rank N"):
        Engine(model_path=ckpt, tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:29999",
               max_total_tokens=512, log_level="warning")
