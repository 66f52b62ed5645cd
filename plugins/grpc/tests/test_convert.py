"""Messages to /generate bodies and cumulative outputs to delta responses (no server)."""

from __future__ import annotations

import json
import math

from engine_grpc import convert
from engine_grpc import plugserve_pb2 as pb
from engine_grpc.client import collect


def test_only_the_fields_set_reach_the_body() -> None:
    request = pb.GenerateRequest(text="Hi", stream=True, rid="r1", priority=2, sampling_params=pb.SamplingParams(
        temperature=0.0, max_new_tokens=5, stop=["\n"], stop_token_ids=[7], logit_bias={3: -1.5}, ignore_eos=False))
    assert convert.generate_body(request) == {
        "stream": True, "text": "Hi", "rid": "r1", "priority": 2,
        # temperature 0 and ignore_eos false are set (proto3 optional), so they are sent; the rest is not.
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "stop": ["\n"], "stop_token_ids": [7],
                            "ignore_eos": False, "logit_bias": {"3": -1.5}},
    }
    ids = pb.GenerateRequest(input_ids=pb.TokenIds(ids=[1, 2]), return_logprob=True, top_logprobs_num=3,
                             logprob_start_len=0)
    assert convert.generate_body(ids) == {"stream": False, "input_ids": [1, 2], "sampling_params": {},
                                          "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}
    # No prompt: the engine's own check answers (it names the field).
    assert "text" not in convert.generate_body(pb.GenerateRequest()) and "input_ids" not in convert.generate_body(pb.GenerateRequest())


def _out(index: int, ids: list[int], text: str, reason: dict | None = None, logprobs: int = 0) -> dict:
    meta = {"id": f"r-{index}", "prompt_tokens": 4, "completion_tokens": len(ids), "cached_tokens": 1,
            "finish_reason": reason, "e2e_latency": 0.5}
    if logprobs:
        meta["output_token_logprobs"] = [[-0.5 * (i + 1), t, None] for i, t in enumerate(ids)]
        meta["output_top_logprobs"] = [[[-0.1, 9, None], [None, 8, None]] for _ in ids]
        meta["input_token_logprobs"] = [[None, 1, None], [-2.0, 2, None]]  # every output repeats them
        meta["input_top_logprobs"] = [None, None]
    return {"index": index, "text": text, "output_ids": ids, "meta_info": meta}


def test_cumulative_outputs_become_deltas_per_choice() -> None:
    builder = convert.ResponseBuilder()
    outs = [_out(0, [5], "He", logprobs=1), _out(1, [6], "Yo"), _out(0, [5, 7], "Hello", logprobs=1),
            _out(1, [6, 8], "Yo!", {"type": "stop", "matched": 8}),
            _out(0, [5, 7, 9], "Hello.", {"type": "stop", "matched": "."}, logprobs=1)]
    responses = [builder.response(o) for o in outs]
    assert [(r.index, list(r.token_ids), r.text) for r in responses] == [
        (0, [5], "He"), (1, [6], "Yo"), (0, [7], "llo"), (1, [8], "!"), (0, [9], ".")]
    assert [len(r.logprobs) for r in responses] == [1, 0, 1, 0, 1]
    assert [len(r.input_logprobs) for r in responses] == [2, 0, 0, 0, 0]  # a choice's first response only
    assert math.isnan(responses[0].input_logprobs[0].logprob) and responses[0].input_logprobs[1].logprob == -2.0
    assert responses[2].logprobs[0].token_id == 7 and responses[2].logprobs[0].logprob == -1.0
    assert [t.token_id for t in responses[2].logprobs[0].top] == [9, 8]
    assert math.isnan(responses[2].logprobs[0].top[1].logprob)  # null: no logprob
    assert not responses[0].HasField("finish_reason") and responses[3].finish_reason.matched_token_id == 8
    first, second = collect(responses)
    assert (first.rid, first.text, first.token_ids, first.finish_reason, first.matched) == ("r-0", "Hello.", [5, 7, 9], "stop", ".")
    assert (second.text, second.token_ids, second.matched, second.completion_tokens) == ("Yo!", [6, 8], 8, 2)
    assert (first.prompt_tokens, first.cached_tokens, len(first.logprobs)) == (4, 1, 3)


def test_finish_reasons() -> None:
    assert convert.finish_reason({"type": "length"}).WhichOneof("matched") is None
    aborted = convert.finish_reason({"type": "abort", "message": "client gone"})
    assert (aborted.type, aborted.message) == ("abort", "client gone")


def test_info_messages() -> None:
    info = convert.model_info({"model_path": "/m", "served_model_name": "m", "tokenizer_path": "/m",
                               "is_generation": True, "context_len": 1024, "chat_template": None,
                               "special_tokens": {"eos_token": "</s>"}})
    assert (info.context_len, info.chat_template, dict(info.special_tokens)) == (1024, "", {"eos_token": "</s>"})
    document = {"version": "0.1.0", "num_running_reqs": 2, "kv_used_tokens": 30, "plugins": [{"name": "x"}]}
    server = convert.server_info(document)
    assert (server.num_running_reqs, server.kv_used_tokens, json.loads(server.json)) == (2, 30, document)
