"""End to end under load: 200 concurrent streams complete exactly, and dropped streams free their KV."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import httpx
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

CONCURRENCY = 200
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, llama_ckpt_dir: str) -> Server:
    return shared_server(request.config, tmp_path_factory, llama_ckpt_dir)


def test_200_concurrent_streams(server: Server) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, str | None]:
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=f"Request number {i} says", max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, tokens, reason = "", -1, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return text, tokens, reason

    async def main() -> list[Any]:
        limits = httpx.Limits(max_connections=CONCURRENCY + 10, max_keepalive_connections=CONCURRENCY + 10)
        async with httpx.AsyncClient(limits=limits, timeout=120) as http:
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, http_client=http)
            return await asyncio.gather(*(one(client, i) for i in range(CONCURRENCY)), return_exceptions=True)

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(tokens == MAX_TOKENS and reason == "length" and text for text, tokens, reason in results)
    assert_no_kv_leak(wait_idle(server))


def test_disconnected_streams_free_their_kv(server: Server) -> None:
    dropped = 50

    async def drop_midway(http: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL_NAME, "prompt": f"Disconnect {i} after a few tokens", "max_tokens": 500,
                "temperature": 0, "stream": True, "ignore_eos": True}
        seen = 0
        async with http.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    json.loads(line[6:])
                    seen += 1
                    if seen == 3:
                        break  # leaving the block closes the connection mid-stream
        return seen

    async def main() -> list[Any]:
        limits = httpx.Limits(max_connections=dropped + 5)
        async with httpx.AsyncClient(limits=limits, timeout=120) as http:
            return await asyncio.gather(*(drop_midway(http, i) for i in range(dropped)), return_exceptions=True)

    steps_before = wait_idle(server)["forward_steps"]
    results = asyncio.run(main())
    assert all(r == 3 for r in results), results[:3]
    info = wait_idle(server, timeout=20)
    assert_no_kv_leak(info)
    assert info["num_inflight_reqs"] == 0
    # Aborted after a few tokens, not decoded to max_tokens (500 steps) behind the client's back.
    assert info["forward_steps"] - steps_before < 250, info


def test_abandoned_non_streamed_requests_are_aborted(server: Server) -> None:
    steps_before = wait_idle(server)["forward_steps"]

    async def give_up(http: httpx.AsyncClient, i: int) -> str:
        body = {"input_ids": [9, 10, i], "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}
        try:
            await http.post(server.url + "/generate", json=body, headers=server.headers, timeout=0.5)
        except httpx.TimeoutException:
            return "timed out"
        return "finished"

    async def main() -> list[str]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=30)) as http:
            return await asyncio.gather(*(give_up(http, i) for i in range(20)))

    assert asyncio.run(main()) == ["timed out"] * 20
    info = wait_idle(server, timeout=20)
    assert_no_kv_leak(info)
    assert info["forward_steps"] - steps_before < 400, info
