"""The prefill/decode router's choice of servers per kind (``engine router --policy``), against
scripted servers (httpx.MockTransport; no engine, no sockets)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from engine.disaggregation.router import PDRouter, PrefillServer, prompt_key, route

PREFILLS = ["http://p0:1", "http://p1:1"]
DECODES = ["http://d0:2", "http://d1:2", "http://d2:2"]


def _router(policy: str = "shortest-queue") -> PDRouter:
    return PDRouter([PrefillServer(u, 8998) for u in PREFILLS], list(DECODES), policy=policy)


class _Servers:
    """Prefill servers answer at once; a decode server holds each request until ``release``."""

    def __init__(self) -> None:
        self.decode_hits: list[str] = []
        self.prefill_hits: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = f"http://{request.url.host}:{request.url.port}"
        body = json.loads(request.content)
        if host in PREFILLS:
            self.prefill_hits.append(host)
            return httpx.Response(200, json={})
        self.decode_hits.append(host)
        gate = self.gates.setdefault(body["rid"], asyncio.Event())
        await gate.wait()
        return httpx.Response(200, json={"text": host})

    def release(self, rid: str) -> None:
        self.gates.setdefault(rid, asyncio.Event()).set()


def _in_flight(router: PDRouter, kind: str) -> list[int]:
    return [s["in_flight_requests"] for s in router.stats()["servers"][kind]]


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_shortest_queue_sends_each_request_to_the_server_with_the_fewest_in_flight() -> None:
    async def main() -> None:
        servers, router = _Servers(), _router()
        async with httpx.AsyncClient(transport=httpx.MockTransport(servers)) as client:
            first = [asyncio.ensure_future(route(client, router, "/generate", {"text": "a", "rid": f"r{i}"}))
                     for i in range(3)]
            await _settle()
            assert sorted(servers.decode_hits) == DECODES  # idle servers are taken in turn
            assert _in_flight(router, "decode") == [1, 1, 1]
            assert _in_flight(router, "prefill") == [0, 0]  # the prefill halves answered
            servers.release("r1")  # d1 frees up; d0 and d2 stay busy
            assert (await first[1])[1] == {"text": DECODES[1]}
            assert _in_flight(router, "decode") == [1, 0, 1]
            nxt = asyncio.ensure_future(route(client, router, "/generate", {"text": "b", "rid": "r3"}))
            await _settle()
            assert servers.decode_hits[-1] == DECODES[1]
            for rid in ("r0", "r2", "r3"):
                servers.release(rid)
            await asyncio.gather(*first, nxt)
            assert _in_flight(router, "decode") == [0, 0, 0]
            assert sorted(servers.prefill_hits) == sorted(PREFILLS * 2)
            assert router.stats()["policy"] == "shortest-queue"

    asyncio.run(main())


def test_round_robin_ignores_load() -> None:
    async def main() -> None:
        servers, router = _Servers(), _router("round-robin")
        async with httpx.AsyncClient(transport=httpx.MockTransport(servers)) as client:
            held = asyncio.ensure_future(route(client, router, "/generate", {"text": "a", "rid": "held"}))
            await _settle()
            others = []
            for i in range(3):
                servers.release(f"q{i}")
                others.append(await route(client, router, "/generate", {"text": "a", "rid": f"q{i}"}))
            # d0 still holds "held", yet its turn comes again.
            assert servers.decode_hits == [DECODES[0], DECODES[1], DECODES[2], DECODES[0]]
            servers.release("held")
            await held

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_loads_are_released_when_the_decode_server_fails(stream: bool) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host.startswith("p"):
            return httpx.Response(200, json={})
        if stream:
            async def broken() -> Any:
                yield b'data: {"text": "a"}\n\n'
                raise httpx.ReadError("connection reset")
            return httpx.Response(200, content=broken())
        raise httpx.ConnectError("connection refused")

    async def main() -> PDRouter:
        router = _router()
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            for _ in range(4):
                try:
                    _, data = await route(client, router, "/generate", {"text": "a", "stream": stream})
                except Exception:  # noqa: BLE001 - the 502 of a non-streamed request
                    continue
                async for _chunk in data:
                    pass
        return router

    router = asyncio.run(main())
    assert _in_flight(router, "decode") == [0, 0, 0] and _in_flight(router, "prefill") == [0, 0]
    routed = [s["routed_requests"] for s in router.stats()["servers"]["decode"]]
    assert sum(routed) == 4 and max(routed) - min(routed) <= 1


def test_prompt_keys() -> None:
    assert prompt_key("/generate", {"input_ids": [5, 6, 7]}) == [5, 6, 7]
    assert prompt_key("/generate", {"input_ids": [[1, 2], [3]]}) == [1, 2]
    assert prompt_key("/generate", {"text": ["hé", "x"]}) == list("hé".encode())
    assert prompt_key("/v1/completions", {"prompt": "abc"}) == [97, 98, 99]
    chat = prompt_key("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert bytes(chat).decode() == '[{"role":"user","content":"hi"}]'
    assert prompt_key("/v1/completions", {"prompt": None}) == []


def test_router_cli_refuses_an_unknown_policy_with_status_2() -> None:
    from typer.testing import CliRunner

    from engine.cli import app

    result = CliRunner().invoke(app, ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                                      "--policy", "coin-flip", "--wait-s", "0"])
    assert result.exit_code == 2
    assert "--policy: invalid value 'coin-flip'" in result.output and "shortest-queue" in result.output
    result = CliRunner().invoke(app, ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                                      "--decode-policy", "dice", "--wait-s", "0"])
    assert result.exit_code == 2 and "--decode-policy: invalid value 'dice'" in result.output


def test_decode_servers_can_have_their_own_policy() -> None:
    async def main() -> None:
        servers = _Servers()
        router = PDRouter([PrefillServer(u, 8998) for u in PREFILLS], list(DECODES), policy="cache-aware",
                          decode_policy="round-robin")
        async with httpx.AsyncClient(transport=httpx.MockTransport(servers)) as client:
            held = asyncio.ensure_future(route(client, router, "/generate", {"text": "same prompt", "rid": "h"}))
            await _settle()
            for i in range(3):
                servers.release(f"s{i}")
                await route(client, router, "/generate", {"text": "same prompt", "rid": f"s{i}"})
            servers.release("h")
            await held
        assert servers.decode_hits == [DECODES[0], DECODES[1], DECODES[2], DECODES[0]]  # in turn, busy or not
        assert router.stats()["policy"] == "cache-aware" and router.stats()["decode_policy"] == "round-robin"

    asyncio.run(main())


def test_cache_aware_sends_a_shared_prefix_to_the_prefill_server_that_saw_it() -> None:
    async def main() -> None:
        servers, router = _Servers(), _router("cache-aware")
        system = "You are a careful assistant. " * 20
        async with httpx.AsyncClient(transport=httpx.MockTransport(servers)) as client:
            for i, question in enumerate(["first?", "second?", "third?"]):
                servers.release(f"c{i}")
                await route(client, router, "/generate", {"text": system + question, "rid": f"c{i}"})
            servers.release("other")
            await route(client, router, "/generate", {"text": "Something else entirely. " * 20, "rid": "other"})
        assert len(set(servers.prefill_hits[:3])) == 1  # the shared system prompt stays on one server
        assert servers.prefill_hits[3] != servers.prefill_hits[0]  # an unrelated prompt goes to the other

    asyncio.run(main())
