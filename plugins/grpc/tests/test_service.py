"""The gRPC service over a fake ``NativeAPI``, in process: statuses, the API key, cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest
from engine_grpc import plugserve_pb2 as pb
from engine_grpc import plugserve_pb2_grpc as pb_grpc
from engine_grpc.server import start

from engine.entrypoints.frontend import APIError
from engine.ports import free_port

KEY = (("authorization", "Bearer k"),)


class FakeAPI:
    """Streams 'a', 'aa', ... until closed; records what the service did with it."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.open_calls = 0
        self.bodies: list[dict[str, Any]] = []

    def authorize(self, authorization: str | None) -> None:
        if authorization != "Bearer k":
            raise APIError(401, "invalid API key", code="invalid_api_key")

    @contextmanager
    def arrival(self) -> Iterator[None]:
        self.open_calls += 1
        try:
            yield
        finally:
            self.open_calls -= 1

    async def generate(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self.bodies.append(body)
        if body["sampling_params"].get("top_k") == 0:
            raise APIError(400, "sampling parameter 'top_k': invalid value 0", param="top_k")
        if body.get("rid") == "boom":
            raise ZeroDivisionError("a bug")
        try:
            for i in range(1, 10_000):
                reason = {"type": "abort", "message": "aborted by request"} if body.get("rid") == "ab" and i == 2 else None
                if body.get("rid") == "forty" and i == 40:
                    reason = {"type": "length"}
                yield {"index": 0, "text": "a" * i, "output_ids": list(range(i)),
                       "meta_info": {"id": "r", "prompt_tokens": 1, "completion_tokens": i, "finish_reason": reason}}
                if reason:
                    return
                await asyncio.sleep(0.005)
        finally:
            self.closed.set()

    def abort(self, rid: str) -> list[str]:
        raise APIError(404, f"rid: no running request has id '{rid}'", param="rid", code="request_not_found")

    async def health(self) -> None:
        return None

    def model_info(self) -> dict[str, Any]:
        return {"served_model_name": "fake", "context_len": 16}

    async def server_info(self) -> dict[str, Any]:
        return {"num_running_reqs": 0}


async def _with_server(check: Any) -> FakeAPI:
    api = FakeAPI()
    port = free_port()
    frontend = await start(api, "127.0.0.1", port)  # type: ignore[arg-type]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await check(pb_grpc.EngineStub(channel), api)
    finally:
        await frontend.stop(None)
    return api


def test_statuses_name_the_field_and_the_key_is_required() -> None:
    async def check(stub: pb_grpc.EngineStub, api: FakeAPI) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.GetModelInfo(pb.GetModelInfoRequest())
        assert bad.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (await stub.Health(pb.HealthRequest())).status == "ok"  # no key needed, as /health
        assert (await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=KEY)).served_model_name == "fake"
        call = stub.Generate(pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(top_k=0)), metadata=KEY)
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            async for _ in call:
                pass
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_k" in bad.value.details()
        assert ("param", "top_k") in list(bad.value.trailing_metadata())
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.Abort(pb.AbortRequest(rid="x"), metadata=KEY)
        assert bad.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            async for _ in stub.Generate(pb.GenerateRequest(text="x", rid="boom"), metadata=KEY):
                pass
        assert bad.value.code() == grpc.StatusCode.INTERNAL and "ZeroDivisionError" in bad.value.details()
        # An aborted choice: its last response says so, then the call ends ABORTED.
        seen = []
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            async for response in stub.Generate(pb.GenerateRequest(text="x", rid="ab", stream=True), metadata=KEY):
                seen.append(response)
        assert bad.value.code() == grpc.StatusCode.ABORTED and seen[-1].finish_reason.type == "abort"
        assert [r.text for r in seen] == ["a", "a"] and api.open_calls == 0

    asyncio.run(_with_server(check))


def test_a_cancelled_stream_closes_the_generation_at_once() -> None:
    async def check(stub: pb_grpc.EngineStub, api: FakeAPI) -> None:
        call = stub.Generate(pb.GenerateRequest(text="x", stream=True), metadata=KEY)
        texts = []
        async for response in call:
            texts.append(response.text)
            if len(texts) == 3:
                call.cancel()
                break
        assert texts == ["a", "a", "a"]  # deltas of the cumulative "a", "aa", "aaa"
        await asyncio.wait_for(api.closed.wait(), 5)
        for _ in range(100):  # the handler leaves once its generator is closed
            if api.open_calls == 0:
                break
            await asyncio.sleep(0.01)
        assert api.open_calls == 0

    api = asyncio.run(_with_server(check))
    assert api.bodies[0]["stream"] is True


def test_stop_refuses_new_calls_and_lets_those_in_flight_finish() -> None:
    async def main() -> None:
        api = FakeAPI()
        port = free_port()
        frontend = await start(api, "127.0.0.1", port)  # type: ignore[arg-type]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.EngineStub(channel)
            call = stub.Generate(pb.GenerateRequest(text="x", rid="forty", stream=True), metadata=KEY)
            texts = [(await call.read()).text]
            stopping = asyncio.ensure_future(frontend.stop(10))
            await asyncio.sleep(0.05)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Health(pb.HealthRequest())
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            while (response := await call.read()) is not grpc.aio.EOF:
                texts.append(response.text)
            assert await call.code() == grpc.StatusCode.OK and "".join(texts) == "a" * 40
            await asyncio.wait_for(stopping, 5)

    asyncio.run(main())
