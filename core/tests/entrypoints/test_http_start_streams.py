"""``start_requests``: a response's requests go to the scheduler from the request handler (streamed
or not), and every request sent is ended (an abort when unfinished) however its response ends."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from engine.entrypoints.http.generation import (
    Choice,
    SSEResponse,
    run_to_completion,
    sse_response,
    start_requests,
    stream_outputs,
)
from engine.managers.io_struct import AbortReq, BatchStrOut, TokenizedGenerateReqInput
from engine.managers.tokenizer_manager import GenerateRequest, RequestError, TokenizerManager
from engine.router.router import Router
from engine.sampling.sampling_params import SamplingParams


class _Sock:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send_pyobj(self, msg: Any) -> None:
        self.sent.append(msg)


async def _never_body() -> Any:
    """A response body whose first chunk is never sent (the client left first)."""
    yield b"never"


async def _gone_send(message: Any) -> None:
    raise OSError("the client went away")


async def _gone_receive() -> Any:
    return {"type": "http.disconnect"}


class _Manager(TokenizerManager):
    """The real manager's request path, with a recording socket for the scheduler's."""

    def __init__(self) -> None:
        self.sock = _Sock()
        self.sends = [self.sock]
        self.send = self.sock
        self.states: dict[str, Any] = {}
        self.groups: dict[str, set[str]] = {}
        self._group_of: dict[str, list[str]] = {}
        self.router = Router(1)
        self.on_route: list[Any] = []
        self.on_finish: list[Any] = []
        self.dead: str | None = None
        self.draining = False
        self.lora = SimpleNamespace(resolve=lambda path: None)
        self._tasks = [object()]  # start() is a no-op: no receive loop, outputs are fed by hand

    def kinds(self) -> list[str]:
        return [type(m).__name__ for m in self.sock.sent]

    def feed(self, rid: str, token: int, finished: bool) -> None:
        reason = {"type": "length", "length": 2} if finished else None
        self._handle_str_out(BatchStrOut([rid], ["x"], [[token]], [reason], [3], [1], [0]))


def _choice(index: int, rid: str) -> Choice:
    return Choice(index, 0, GenerateRequest(input_ids=[1, 2, 3], rid=rid), ([1, 2, 3], SamplingParams(max_new_tokens=2)))


def test_sent_from_the_handler_and_streamed() -> None:
    async def run() -> list[list[int]]:
        manager = _Manager()
        choices = [_choice(0, "a")]
        start_requests(SimpleNamespace(manager=manager), choices, stream=True)
        assert manager.kinds() == ["TokenizedGenerateReqInput"] and "a" in manager.states
        assert manager.sock.sent[0].stream is True
        outs = stream_outputs(SimpleNamespace(manager=manager), choices)
        manager.feed("a", 7, False)
        first = await outs.__anext__()
        manager.feed("a", 8, True)
        last = await outs.__anext__()
        with pytest.raises(StopAsyncIteration):
            await outs.__anext__()
        assert manager.states == {} and "AbortReq" not in manager.kinds()
        return [first[1]["output_ids"], last[1]["output_ids"]]

    assert asyncio.run(run()) == [[7], [7, 8]]


def test_a_response_that_never_ran_its_body_aborts_its_requests() -> None:
    async def run() -> None:
        manager = _Manager()
        choices = [_choice(0, "a"), _choice(1, "b")]
        start_requests(SimpleNamespace(manager=manager), choices, stream=True)
        assert set(manager.states) == {"a", "b"}

        scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST"}
        with pytest.raises(ClientDisconnect):
            await SSEResponse(_never_body(), choices)(scope, _gone_receive, _gone_send)
        assert manager.states == {}
        assert sorted(m.rid for m in manager.sock.sent if isinstance(m, AbortReq)) == ["a", "b"]

    asyncio.run(run())


def test_a_failed_send_is_raised_by_the_stream_and_ends_the_others() -> None:
    async def run() -> None:
        manager = _Manager()
        choices = [_choice(0, "same"), _choice(1, "same")]  # the second send is refused: rid in use
        start_requests(SimpleNamespace(manager=manager), choices, stream=True)
        assert choices[1].start_error is not None
        with pytest.raises(RequestError, match="already running"):
            await stream_outputs(SimpleNamespace(manager=manager), choices).__anext__()
        assert manager.states == {} and [type(m) for m in manager.sock.sent] == [TokenizedGenerateReqInput, AbortReq]

    asyncio.run(run())


def test_a_manager_that_does_not_send_on_submit_is_followed_through_generate() -> None:
    class Own(_Manager):
        sends_on_submit = False

        async def generate(self, req: GenerateRequest, prepared: Any = None) -> Any:
            yield {"text": "own", "output_ids": [5], "meta_info": {}}

    async def run() -> list[Any]:
        manager = Own()
        choices = [_choice(0, "a")]
        start_requests(SimpleNamespace(manager=manager), choices, stream=True)
        assert choices[0].started is None and manager.sock.sent == []
        return [out async for _, out in stream_outputs(SimpleNamespace(manager=manager), choices)]

    assert asyncio.run(run()) == [{"text": "own", "output_ids": [5], "meta_info": {}}]


def test_a_non_streamed_response_sends_at_once_and_returns_the_final_output() -> None:
    async def run() -> dict[str, Any]:
        manager = _Manager()
        choices = [_choice(0, "a")]
        never = asyncio.Event()

        async def receive() -> Any:
            await never.wait()  # the client stays

        task = asyncio.ensure_future(run_to_completion(SimpleNamespace(manager=manager), choices,
                                                       SimpleNamespace(receive=receive)))
        await asyncio.sleep(0)
        assert manager.kinds() == ["TokenizedGenerateReqInput"] and manager.sock.sent[0].stream is False
        manager.feed("a", 7, False)
        manager.feed("a", 8, True)
        (out,) = await task
        assert manager.states == {} and "AbortReq" not in manager.kinds()
        return out

    assert asyncio.run(run())["output_ids"] == [7, 8]


def test_sse_response_sends_now_and_ends_its_requests_with_the_response() -> None:
    async def run() -> None:
        manager = _Manager()
        choices = [_choice(0, "a")]

        response = sse_response(SimpleNamespace(manager=manager), choices, _never_body())
        assert manager.kinds() == ["TokenizedGenerateReqInput"] and manager.sock.sent[0].stream is True
        with pytest.raises(ClientDisconnect):
            scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST"}
            await response(scope, _gone_receive, _gone_send)
        assert manager.states == {} and manager.kinds() == ["TokenizedGenerateReqInput", "AbortReq"]

    asyncio.run(run())


def test_a_failed_send_fails_a_non_streamed_response_without_sending_the_rest() -> None:
    async def run() -> None:
        manager = _Manager()
        choices = [_choice(0, "same"), _choice(1, "same"), _choice(2, "c")]  # the second send is refused

        async def receive() -> Any:
            await asyncio.Event().wait()  # the client stays

        with pytest.raises(RequestError, match="already running"):
            await run_to_completion(SimpleNamespace(manager=manager), choices, SimpleNamespace(receive=receive))
        assert manager.states == {} and [(type(m), m.rid) for m in manager.sock.sent] == [
            (TokenizedGenerateReqInput, "same"), (AbortReq, "same")]

    asyncio.run(run())
