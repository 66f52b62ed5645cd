"""The prefill/decode router against scripted servers (httpx.MockTransport; no engine, no sockets)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from engine.disaggregation.router import PDRouter, PrefillServer, RouterError, route

PREFILL, DECODE = "http://p:1", "http://d:2"


def _router() -> PDRouter:
    return PDRouter([PrefillServer(PREFILL, 8998)], [DECODE], api_key="k")


def _run(handler: Callable[[httpx.Request], Any], path: str, body: dict[str, Any]) -> tuple[int, Any, list[Any]]:
    """Routes one request; returns (status, JSON body or the SSE events, the requests the servers saw)."""
    seen: list[Any] = []

    async def record(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), json.loads(request.content)))
        return await handler(request)

    async def main() -> tuple[int, Any]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(record)) as client:
            try:
                status, data = await route(client, _router(), path, body)
            except RouterError as err:
                return err.status, err.body
            if isinstance(data, (dict, list)):
                return status, data
            return status, [json.loads(c[6:]) for chunk in [b"".join([c async for c in data])]
                            for c in chunk.decode().split("\n\n") if c.startswith("data: {")]

    status, data = asyncio.run(main())
    return status, data, seen


async def _sse(events: list[dict[str, Any]], delay: float = 0.0) -> AsyncIterator[bytes]:
    for event in events:
        await asyncio.sleep(delay)
        yield f"data: {json.dumps(event)}\n\n".encode()


def test_both_halves_get_the_same_room_and_ids_and_the_client_the_decode_answer() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "p":
            return httpx.Response(200, json={"text": "x", "output_ids": [1]})
        return httpx.Response(200, json=[{"text": "decoded", "i": 0}, {"text": "decoded", "i": 1}])

    status, data, seen = _run(handler, "/generate", {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 4}})
    assert status == 200 and data[0]["text"] == "decoded"
    (p_url, p_body), (d_url, d_body) = sorted(seen, key=lambda s: s[0] != PREFILL + "/generate")
    assert p_url == PREFILL + "/generate" and d_url == DECODE + "/generate"
    assert p_body["bootstrap_room"] == d_body["bootstrap_room"] and p_body["rid"] == d_body["rid"]
    assert len(d_body["rid"]) == 2 and d_body["bootstrap_host"] == "p" and d_body["bootstrap_port"] == 8998
    assert p_body["stream"] is False


def test_a_prefill_error_is_the_answer() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "p":
            return httpx.Response(400, json={"error": {"message": "temperature: bad", "param": "temperature"}})
        await asyncio.sleep(30)  # the decode half waits for KV that never comes: cancelled
        return httpx.Response(200, json={})

    status, data, _ = _run(handler, "/v1/completions", {"prompt": "hi"})
    assert status == 400 and data["error"]["param"] == "temperature"


@pytest.mark.parametrize("stream", [False, True])
def test_an_unreachable_prefill_server_fails_the_request_naming_it(stream: bool) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "p":
            await asyncio.sleep(0.05)
            raise httpx.ConnectError("connection refused")
        if stream:
            return httpx.Response(200, content=_sse([{"text": "a"}] * 50, delay=0.02))
        # A decode server answers only once the KV came; here it never does in time.
        await asyncio.sleep(5)
        return httpx.Response(200, json={"text": "never"})

    status, data, _ = _run(handler, "/generate", {"text": "hi", "stream": stream})
    if stream:
        assert status == 200 and "prefill server http://p:1 failed" in data[-1]["error"]["message"]
        assert len(data) < 50
    else:
        assert status == 502 and "prefill server http://p:1 failed" in data["error"]["message"]


def test_a_decode_server_gone_ends_the_request() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "p":
            return httpx.Response(200, json={})
        raise httpx.ConnectError("connection refused")

    status, data, _ = _run(handler, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 502 and "decode server http://d:2 failed" in data["error"]["message"]


def test_a_stream_is_relayed_as_it_comes() -> None:
    events = [{"choices": [{"text": t}]} for t in "abc"]

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "p":
            return httpx.Response(200, json={})
        return httpx.Response(200, content=_sse(events))

    status, data, seen = _run(handler, "/v1/completions", {"prompt": "hi", "stream": True,
                                                           "stream_options": {"include_usage": True}})
    assert status == 200 and data == events
    prefill_body = next(body for url, body in seen if url.startswith(PREFILL))
    assert "stream_options" not in prefill_body and prefill_body["stream"] is False
