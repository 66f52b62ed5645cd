"""Pure pieces of the HTTP server: error mapping, logprob formats, metrics, start-up helpers."""

from __future__ import annotations

import math
import socket
from types import SimpleNamespace
from typing import Any

import pytest

from engine.config import ServerArgs
from engine.entrypoints.http_server import bind_socket, ready_line, server_url
from engine.entrypoints.http.context import DEFAULT_MODEL_NAME, ServingContext, served_model_name
from engine.entrypoints.http.errors import APIError, from_request_error, parse_body
from engine.entrypoints.http.generation import Choice, finish_reason, usage
from engine.entrypoints.http.logprobs import chat_logprobs, completion_logprobs, native_logprobs
from engine.entrypoints.http.protocol import ChatCompletionRequest, CompletionRequest
from engine.errors import ConfigError
from engine.managers.io_struct import SchedulerReady
from engine.managers.tokenizer_manager import GenerateRequest, ReqState, RequestError
from engine.metrics import ServerMetrics


def _error(raw: bytes, model: Any = ChatCompletionRequest) -> APIError:
    with pytest.raises(APIError) as info:
        parse_body(raw, model)
    return info.value


@pytest.mark.parametrize("raw, param, needle", [
    (b'{"messages": [{"role": "user", "content": 1}]}', "messages[0].content", "invalid value 1"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stop": 3}', "stop", "valid string; or input should be a valid array"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}', "max_tokens", "valid integer"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream", "valid boolean"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 1.5}', "n", "valid integer"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokns": 5}', "max_tokns", "did you mean max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream_options": {"include": true}}', "stream_options.include", "unknown field"),
    (b'{}', "messages", "required"),
    # OpenAI answers 400 for these; only an assistant message may omit content.
    (b'{"messages": [{"role": "user"}]}', "messages[0].content", "a user message needs content"),
    (b'{"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": null}]}',
     "messages[1].content", "a user message needs content"),
    (b'{"messages": [{"role": "tool"}]}', "messages[0].content", "a tool message needs content"),
])
def test_validation_errors_name_the_field(raw: bytes, param: str, needle: str) -> None:
    err = _error(raw)
    assert err.status == 400 and err.param == param and needle in err.message, err.message
    assert err.message.startswith(param + ":")


def test_assistant_message_may_omit_content() -> None:
    body = b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}, {"role": "user", "content": "y"}]}'
    assert parse_body(body, ChatCompletionRequest).messages[1].content is None


def test_body_level_errors() -> None:
    assert "not valid JSON" in _error(b'{"a": ').message
    assert "must be a JSON object, got an array" in _error(b"[1]").message
    assert "empty" in _error(b"  ").message


def test_prompt_union_accepts_every_openai_form() -> None:
    for prompt in ("a", ["a", "b"], [1, 2], [[1], [2, 3]]):
        assert parse_body(CompletionRequest.model_validate({"prompt": prompt}).model_dump_json().encode(),
                          CompletionRequest).prompt == prompt


def test_request_error_renames_engine_fields() -> None:
    exc = RequestError("sampling parameter 'max_new_tokens': invalid value -1; accepted: an integer >= 0", "max_new_tokens")
    err = from_request_error(exc, {"max_new_tokens": "max_tokens"})
    assert err.param == "max_tokens" and "'max_tokens'" in err.message and "max_new_tokens" not in err.message
    body = err.body()["error"]
    assert body == {"message": err.message, "type": "invalid_request_error", "param": "max_tokens", "code": None}


def test_finish_reasons_and_usage() -> None:
    assert finish_reason({"finish_reason": {"type": "length", "length": 3}}) == "length"
    assert finish_reason({"finish_reason": {"type": "stop", "matched": 3}}) == "stop"
    assert finish_reason({"finish_reason": None}) is None
    with pytest.raises(APIError, match="aborted: out of KV"):
        finish_reason({"finish_reason": {"type": "abort", "message": "out of KV"}})
    choices = [Choice(i, i // 2, GenerateRequest(), ([1, 2, 3], None)) for i in range(4)]  # type: ignore[arg-type]
    outputs = {i: {"meta_info": {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 1}} for i in range(4)}
    assert usage(choices, outputs) == {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14,
                                       "prompt_tokens_details": {"cached_tokens": 2}}


def test_logprob_formats() -> None:
    def text(t: int) -> str:
        return f"<{t}>"

    chat = chat_logprobs([(-0.5, 7), (-math.inf, 8)], [[(-0.5, 7), (-1.0, 9)], [(-2.0, 1)]], text, 2)
    assert chat["content"][0] == {"token": "<7>", "logprob": -0.5, "bytes": list(b"<7>"),
                                  "top_logprobs": [{"token": "<7>", "logprob": -0.5, "bytes": list(b"<7>")},
                                                   {"token": "<9>", "logprob": -1.0, "bytes": list(b"<9>")}]}
    assert chat["content"][1]["logprob"] == -9999.0  # JSON has no -Infinity
    legacy = completion_logprobs([(None, 1), (-0.25, 2)], [[], [(-0.25, 2), (-3.0, 4)]], text, 1, 10)
    assert legacy == {"tokens": ["<1>", "<2>"], "token_logprobs": [None, -0.25],
                      "top_logprobs": [None, {"<2>": -0.25}], "text_offset": [10, 13]}
    assert native_logprobs([(-0.5, 7)], None) == [[-0.5, 7, None]]
    assert native_logprobs([(-0.5, 7)], text) == [[-0.5, 7, "<7>"]]


def _ready() -> SchedulerReady:
    return SchedulerReady(max_total_num_tokens=512, max_running_requests=4, context_len=128, vocab_size=100,
                          device="cpu", attention_backend="torch_native", platform="cpu", dtype="float32",
                          eos_token_ids=[2], plugins=[{"name": "cpu", "status": "ok"}, {"name": "bad", "status": "broken"}])


def test_model_names_and_ready_line() -> None:
    assert served_model_name(ServerArgs(), "/cache/default-model-abc") == DEFAULT_MODEL_NAME
    assert served_model_name(ServerArgs(model_path="/m/llama-3/"), "/m/llama-3/") == "llama-3"
    assert served_model_name(ServerArgs(model_path="/m/x", served_model_name="prod"), "/m/x") == "prod"
    ctx = ServingContext(args=ServerArgs(model_path="/m/x"), manager=SimpleNamespace(dead=None),  # type: ignore[arg-type]
                         ready=_ready(), model_path="/m/x", model_name="x", tokenizer=None)
    ctx.check_model("x")
    ctx.check_model("/m/x")
    with pytest.raises(APIError) as info:
        ctx.check_model("y")
    assert info.value.status == 404 and info.value.param == "model"
    line = ready_line(ctx, server_url("::1", 8000))
    assert "\n" not in line and "http://[::1]:8000" in line and "'x'" in line
    assert "attention torch_native" in line and "platform cpu" in line and "plugins: cpu" in line and "bad" not in line


def test_bind_socket_reports_a_busy_port() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        with pytest.raises(ConfigError, match="--port: cannot listen on 127.0.0.1"):
            bind_socket("127.0.0.1", busy.getsockname()[1])
    with pytest.raises(ConfigError, match="--host"):
        bind_socket("no-such-host.invalid", 8000)


def test_metrics_observe_and_render() -> None:
    metrics = ServerMetrics("tiny")
    state = ReqState("r", [1, 2, 3, 4])
    state.created, state.first_token_time, state.last_time = 10.0, 10.5, 11.5
    state.output_ids = [5, 6, 7, 8, 9]
    state.meta = {"prompt_tokens": 4, "completion_tokens": 5, "cached_tokens": 2}
    state.finished_reason = {"type": "length"}
    metrics.observe_finished(state)
    metrics.update_from_server_info({"num_running_reqs": 3, "num_waiting_reqs": 1, "kv_usage": 0.25,
                                     "kv_used_tokens": 8, "max_total_num_tokens": 32, "kv_evictable_tokens": 4})
    assert "\nengine_spec_steps{" not in metrics.render().decode()  # speculation off: no samples
    metrics.update_from_server_info({"spec_verify_steps": 7, "spec_tree_steps": 2, "spec_fallback_steps": 3,
                                     "spec_verified_rows": 10, "spec_emitted_tokens": 25})
    text = metrics.render().decode()
    for kind, value in (("verify", 7), ("tree", 2), ("fallback", 3)):
        assert f'engine_spec_steps{{kind="{kind}",model_name="tiny"}} {value:.1f}' in text
    assert 'engine_spec_mean_accept_length{model_name="tiny"} 2.5' in text
    metrics.update_from_server_info({"num_running_reqs": 3, "num_waiting_reqs": 1, "kv_usage": 0.25,
                                     "kv_used_tokens": 8, "max_total_num_tokens": 32, "kv_evictable_tokens": 4})
    text = metrics.render().decode()
    for line in ('engine_prompt_tokens_total{model_name="tiny"} 4.0',
                 'engine_generation_tokens_total{model_name="tiny"} 5.0',
                 'engine_requests_total{finish_reason="length",model_name="tiny"} 1.0',
                 'engine_cache_hit_rate{model_name="tiny"} 0.5',
                 'engine_num_running_reqs{model_name="tiny"} 3.0',
                 'engine_num_queue_reqs{model_name="tiny"} 1.0',
                 'engine_kv_cache_usage{model_name="tiny"} 0.25',
                 'engine_time_to_first_token_seconds_sum{model_name="tiny"} 0.5',
                 'engine_inter_token_latency_seconds_sum{model_name="tiny"} 0.25',
                 'engine_e2e_request_latency_seconds_sum{model_name="tiny"} 1.5'):
        assert line in text, line
    assert ServerMetrics("other").render() != text.encode()  # own registry per server
