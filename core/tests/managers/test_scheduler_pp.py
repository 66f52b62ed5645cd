"""The pipeline-parallel scheduler (several micro-batches in flight) on the CPU: gloo, one
process per rank, greedy outputs equal to one rank's.

One scenario for every layout: prompts longer than the prefill chunk (chunked prefill), requests
arriving while others decode (prefill and decode micro-batches interleave), different lengths
(requests finish while others are in flight), a streaming request aborted after a few tokens,
and prompt/output logprobs. The micro-batch counters must show more than one micro-batch in
flight, and nothing may stay allocated afterwards.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from engine import Engine
from engine.managers.tokenizer_manager import GenerateRequest
from engine.testing.checkpoints import make_tiny_checkpoint

CHUNK = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("pp-llama")), "LlamaForCausalLM",
                                num_key_value_heads=2, num_hidden_layers=3)


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


def _run(ckpt: str, **kw: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    with Engine(model_path=ckpt, max_total_tokens=1024, chunked_prefill_size=CHUNK, log_level="warning",
                **kw) as eng:
        outs, victim = eng.loop.run_until_complete(_scenario(eng))
        info = eng.get_server_info()
    return outs, victim, info


@pytest.fixture(scope="module")
def reference(ckpt: str) -> dict[str, Any]:
    outs, _, _ = _run(ckpt)
    return outs


@pytest.mark.parametrize("tp, pp", [(1, 2), (1, 3), (2, 2)], ids=["pp2", "pp3", "tp2xpp2"])
def test_micro_batches_in_flight_equal_one_rank(ckpt: str, reference: dict[str, Any], tp: int, pp: int) -> None:
    outs, victim, info = _run(ckpt, tp_size=tp, pp_size=pp)
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
    # Several micro-batches were in the pipeline at once, and every one was processed.
    assert info["pp_max_in_flight"] == pp
    assert info["pp_overlapped_micro_batches"] > 1
    assert info["pp_in_flight_micro_batches"] == 0
    assert info["pp_micro_batches"] == info["forward_steps"]
    # No KV left held by a request (the prefix cache may keep what it cached).
    assert info["kv_used_tokens"] == 0 and info["num_running_reqs"] == 0


def test_kv_pressure_retracts_and_still_equals_one_rank(ckpt: str) -> None:
    """A pool too small for every request at once: decode micro-batches wait for those in flight,
    then requests are retracted and recomputed; outputs stay those of one rank."""
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 1000) for _ in range(20)] for _ in range(6)]
    params = {"max_new_tokens": 40, "temperature": 0}

    def run(**kw: Any) -> tuple[list[list[int]], dict[str, Any]]:
        with Engine(model_path=ckpt, max_total_tokens=100, log_level="warning", **kw) as eng:
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            return [o["output_ids"] for o in outs], eng.get_server_info()

    ref, _ = run()
    got, info = run(pp_size=2)
    assert got == ref
    assert info["num_retractions"] > 0 and info["pp_max_in_flight"] == 2
    assert info["kv_used_tokens"] == 0
