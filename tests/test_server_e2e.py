"""End to end: ``engine serve`` on a tiny checkpoint, spoken to with the official ``openai`` client."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import (  # noqa: E402
    API_KEY,
    MODEL_NAME,
    Server,
    assert_no_kv_leak,
    shared_server,
    wait_idle,
)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea"}]


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, llama_ckpt_dir: str) -> Server:
    return shared_server(request.config, tmp_path_factory, llama_ckpt_dir)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_chat_completion(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                         user="tester", extra_body={"ignore_eos": True})
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == MODEL_NAME
    choice = out.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length" and choice.message.role == "assistant"
    assert choice.message.content
    assert out.usage is not None and out.usage.completion_tokens == 8 and out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=10, temperature=0,
                              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, temperature=0,
                              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    text = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert text == full.choices[0].text


def test_n_choices_with_seed(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=1.0,
                                         n=2, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage is not None and out.usage.completion_tokens == 12
    again = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=1.0,
                                           n=2, seed=7, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    streamed = list(client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=3, n=2, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert {c.choices[0].index for c in streamed if c.choices} == {0, 1}


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL_NAME, prompt="The lazy dog", temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw, max_tokens=16).choices[0].text
    stop = full[len(full) // 2:][:3]
    assert stop.strip(), full
    cut = client.completions.create(**kw, max_tokens=16, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]


def test_logprobs_chat_and_legacy(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)  # greedy picks the top
    legacy = client.completions.create(model=MODEL_NAME, prompt="Hello world again", max_tokens=3, temperature=0,
                                       logprobs=2, echo=True, extra_body={"ignore_eos": True}).choices[0]
    lp = legacy.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert legacy.text.startswith("Hello world again") and "".join(lp.tokens) == legacy.text
    assert lp.text_offset is not None and lp.text_offset[0] == 0


def test_usage_reports_cached_tokens_on_a_repeated_prompt(client: openai.OpenAI) -> None:
    prompt = "A long shared prefix that the radix cache should keep " * 4
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details is not None  # type: ignore[attr-defined]
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1  # type: ignore[attr-defined]


def test_token_id_prompts_and_batches(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1] and out.usage is not None
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 4


def test_tokenize_round_trip(server: Server) -> None:
    ids = server.post("/v1/tokenize", json={"prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    assert server.post("/v1/detokenize", json={"tokens": ids["tokens"]}).json()["text"] == "Hello world"


@pytest.fixture(scope="module")
def offline_engine(llama_ckpt_dir: str) -> Iterator[Any]:
    from engine import Engine

    with Engine(model_path=llama_ckpt_dir, max_total_tokens=4096) as eng:
        yield eng


def test_greedy_http_equals_offline_engine(server: Server, client: openai.OpenAI, offline_engine: Any) -> None:
    prompts = [[11, 12, 13], [40, 41, 42, 43, 44, 45, 46], [7]]
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    expected = offline_engine.generate(input_ids=prompts, sampling_params=params)
    native = server.post("/generate", json={"input_ids": prompts, "sampling_params": params}).json()
    assert [o["output_ids"] for o in native] == [e["output_ids"] for e in expected]
    via_openai = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    texts = [c.text for c in sorted(via_openai.choices, key=lambda c: c.index)]
    assert texts == [e["text"] for e in expected]


def test_native_generate_stream(server: Server) -> None:
    body = {"text": "Streaming natively", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            "stream": True, "return_logprob": True, "priority": 1}
    r = server.post("/generate", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    lines = [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    # One event per token, except that tokens which reached a busy server together share one event.
    counts = [len(e["output_ids"]) for e in events]
    assert counts == sorted(set(counts)) and counts[-1] == 5 and len(counts) >= 2, counts
    assert all(b["output_ids"][:len(a["output_ids"])] == a["output_ids"] for a, b in zip(events, events[1:], strict=False))
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(events[-1]["meta_info"]["output_token_logprobs"]) == 5


def test_server_info_metrics_and_no_leak(server: Server) -> None:
    info = wait_idle(server)
    assert_no_kv_leak(info)
    assert info["served_model_name"] == MODEL_NAME and info["api_key"] == "<redacted>"
    assert info["attention_backend"] and info["platform"] and any(p["name"] for p in info["plugins"])
    metrics = server.get("/metrics").text
    for name in ("engine_prompt_tokens_total", "engine_generation_tokens_total", "engine_num_running_reqs",
                 "engine_time_to_first_token_seconds_bucket", "engine_e2e_request_latency_seconds_count",
                 "engine_inter_token_latency_seconds_count", "engine_kv_cache_usage", "engine_cache_hit_rate"):
        assert name in metrics, name
    assert server.post("/flush_cache").json()["success"] is True
