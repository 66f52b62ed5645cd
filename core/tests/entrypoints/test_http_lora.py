"""LoRA adapters over HTTP and in the tokenizer manager, in-process (no engine processes).

The routes run on ``test_http_app``'s scripted manager, whose load/unload go through the real
``LoraMixin`` to a scripted scheduler; the manager's own round trip (tokens over ZeroMQ, the
adapter name on ``TokenizedGenerateReqInput``) runs against a scheduler stand-in on real
sockets. Engine-backed behaviour (output equal to PEFT's) is ``tests/test_server_e2e_lora.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.testclient import TestClient

from engine.entrypoints.http.errors import APIError, parse_body
from engine.entrypoints.http.native_request import build_requests
from engine.entrypoints.http.protocol import GenerateReqInput
from engine.managers.io_struct import (
    BatchStrOut,
    LoadLoraAdapterReqInput,
    LoraAdapterReqOutput,
    SchedulerReady,
    TokenizedGenerateReqInput,
    UnloadLoraAdapterReqInput,
)
from engine.managers.tokenizer_lora import LoraRegistry
from engine.managers.tokenizer_manager import GenerateRequest, RequestError, TokenizerManager

sys.path.insert(0, os.path.dirname(__file__))
import test_http_app  # noqa: E402

AUTH = test_http_app.AUTH


class ScriptedScheduler:
    """The scheduler's side of load/unload: a directory with an adapter_config.json loads."""

    def __init__(self, adapters: dict[str, str]) -> None:
        self.loaded = dict(adapters)
        self.silent = False  # never answer (the manager's timeout)

    def answer(self, msg: Any) -> LoraAdapterReqOutput | None:
        if self.silent:
            return None
        if isinstance(msg, LoadLoraAdapterReqInput):
            if not os.path.isfile(os.path.join(msg.path, "adapter_config.json")):
                return LoraAdapterReqOutput(False, f"lora_path: {msg.path!r} has no adapter_config.json",
                                            dict(self.loaded), msg.token)
            self.loaded[msg.name] = msg.path
        elif isinstance(msg, UnloadLoraAdapterReqInput):
            self.loaded.pop(msg.name, None)
        return LoraAdapterReqOutput(True, "done", dict(self.loaded), msg.token)


class LoraManager(test_http_app.ScriptedManager):
    """The scripted manager with a LoRA-enabled scheduler behind ``sends``."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.scheduler = ScriptedScheduler(self.args.lora_paths)
        self.control_waiters: dict[int, asyncio.Future[Any]] = {}
        self._tokens = itertools.count(1)
        manager = self

        class Socket:
            def send_pyobj(self, msg: Any) -> None:
                reply = manager.scheduler.answer(msg)
                if reply is not None:  # as _handle_loop delivers it: on a later turn of the loop
                    fut = manager.control_waiters.pop(reply.token)
                    asyncio.get_running_loop().call_soon(fut.set_result, reply)

        self.sends = [Socket()]


def _adapter_dir(root: Path, name: str) -> str:
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    return str(path)


@pytest.fixture
def client(tokenizer: Any, tmp_path: Path) -> Iterator[TestClient]:
    from engine.config import ServerArgs
    from engine.entrypoints.http_server import create_app

    args = ServerArgs(model_path="/models/tiny", api_key=test_http_app.KEY,
                      lora_paths={"a": _adapter_dir(tmp_path, "a"), "b": _adapter_dir(tmp_path, "b")})
    ready = SchedulerReady(max_total_num_tokens=100, max_running_requests=8, context_len=64,
                           vocab_size=test_http_app.VOCAB, device="cpu", attention_backend="torch_native",
                           platform="cpu", dtype="float32", eos_token_ids=[3], plugins=[])
    runtime = SimpleNamespace(args=args, model_path="/models/tiny", ipc=None, ready=ready, processes=[])
    with TestClient(create_app(runtime, tokenizer, manager_factory=LoraManager), headers=AUTH) as c:
        yield c


tokenizer = test_http_app.tokenizer


def _sent(client: TestClient) -> list[str | None]:
    return [r.lora_path for r in client.app.state.ctx.manager.sent]  # type: ignore[attr-defined]


def test_generate_lora_path_single_and_per_prompt(client: TestClient, tmp_path: Path) -> None:
    body = {"input_ids": [[5, 6], [7, 8], [9]], "sampling_params": {"max_new_tokens": 1}}
    assert client.post("/generate", json={**body, "lora_path": "a"}).status_code == 200
    assert client.post("/generate", json={**body, "lora_path": ["b", None, str(tmp_path / "a")]}).status_code == 200
    assert _sent(client) == ["a", "a", "a", "b", None, "a"]  # a path names the adapter loaded from it
    r = client.post("/generate", json={**body, "lora_path": ["a", "nope", None]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "lora_path[1]", r.text
    assert "'nope' is not loaded" in error["message"] and "'a', 'b'" in error["message"]
    r = client.post("/generate", json={**body, "lora_path": ["a"]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "lora_path: 1 entries for 3 prompts"
    assert len(_sent(client)) == 6  # nothing of a refused request ran


def test_openai_model_selects_an_adapter(client: TestClient) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for model, lora in (("a", "a"), ("tiny:b", "b"), ("tiny", None), ("/models/tiny", None)):
        r = client.post("/v1/chat/completions", json={**chat, "model": model})
        assert r.status_code == 200 and r.json()["model"] == (model if lora else "tiny"), r.text
        assert _sent(client)[-1] == lora
    r = client.post("/v1/completions", json={"model": "b", "prompt": [5, 6], "max_tokens": 1, "stream": True})
    assert r.status_code == 200 and '"model":"b"' in r.text and _sent(client)[-1] == "b"
    r = client.post("/v1/responses", json={"model": "b", "input": "hi", "max_output_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "b" and _sent(client)[-1] == "b", r.text
    r = client.post("/v1/chat/completions", json={**chat, "model": "tiny:zz"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["message"] == ("model 'tiny:zz' does not exist; this server serves 'tiny' and the "
                                            "LoRA adapters 'a', 'b'")


def test_models_list_adapters_and_load_unload_round_trip(client: TestClient, tmp_path: Path) -> None:
    def ids() -> list[tuple[str, str | None]]:
        return [(m["id"], m["parent"]) for m in client.get("/v1/models").json()["data"]]

    assert ids() == [("tiny", None), ("a", "tiny"), ("b", "tiny")]
    assert client.get("/v1/models/a").json()["root"] == str(tmp_path / "a")
    c_dir = _adapter_dir(tmp_path, "c")
    r = client.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": c_dir})
    assert r.status_code == 200 and r.json()["success"] and set(r.json()["loaded_adapters"]) == {"a", "b", "c"}
    assert ids()[-1] == ("c", "tiny")
    assert client.post("/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 1},
                                          "lora_path": "c"}).status_code == 200
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})  # vLLM's name
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"b", "c"}
    r = client.post("/v1/chat/completions", json={"model": "a", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path / "a")}).status_code == 200
    assert [i for i, _ in ids()] == ["tiny", "a", "b", "c"]


@pytest.mark.parametrize("route, body, param, words", [
    ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}, "lora_name", "already loaded"),
    ("/load_lora_adapter", {"lora_name": "d", "lora_path": "/no/such"}, "lora_path", "'/no/such' has no adapter_config"),
    ("/load_lora_adapter", {"lora_name": "tiny", "lora_path": "/x"}, "lora_name", "base model's name"),
    ("/load_lora_adapter", {"lora_name": "d"}, "lora_path", "required"),
    ("/load_lora_adapter", {"lora_name": "d d", "lora_path": "/x"}, "lora_name", "without spaces"),
    ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/x", "load_inplace": True}, "load_inplace", "not supported"),
    ("/unload_lora_adapter", {"lora_name": "zz"}, "lora_name", "'zz' is not loaded; loaded: 'a', 'b'"),
])
def test_load_unload_errors_name_the_field(client: TestClient, route: str, body: dict[str, Any], param: str,
                                           words: str) -> None:
    r = client.post(route, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.json()["error"]["message"], r.text
    assert r.json()["success"] is False and set(r.json()["loaded_adapters"]) == {"a", "b"}  # SGLang's fields


def test_lora_routes_need_the_api_key(client: TestClient) -> None:
    r = client.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": "/x"}, headers={"Authorization": ""})
    assert r.status_code == 401


def test_a_server_without_lora_refuses_adapters_by_name() -> None:
    ctx: Any = SimpleNamespace(context_len=64, manager=SimpleNamespace(lora=LoraRegistry(False, {})))
    with pytest.raises(APIError) as info:
        build_requests(ctx, parse_body(b'{"text": "hi", "lora_path": "a"}', GenerateReqInput))
    assert info.value.param == "lora_path" and "--lora-paths" in info.value.message
    # Null, or a null per prompt, is the base model (SGLang's clients send it on every request).
    prompts, _, _ = build_requests(ctx, parse_body(b'{"text": ["x", "y"], "lora_path": [null, null]}', GenerateReqInput))
    assert [p.lora_path for p in prompts] == [None, None]


async def _scheduler_stand_in(ipc: Any, scheduler: ScriptedScheduler, seen: list[Any]) -> None:
    """Answers load/unload and finishes each generation at once, over the manager's sockets."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    recv, send = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    recv.bind(ipc.replica_scheduler(0))
    send.connect(ipc.tokenizer)
    try:
        while True:
            msg = await recv.recv_pyobj()
            seen.append(msg)
            if isinstance(msg, TokenizedGenerateReqInput):
                await send.send_pyobj(BatchStrOut([msg.rid], ["x"], [[7]], [{"type": "length", "length": 1}],
                                                  [len(msg.input_ids)], [1], [0]))
            else:
                reply = scheduler.answer(msg)
                if reply is not None:
                    await send.send_pyobj(reply)
    finally:
        recv.close(0)
        send.close(0)
        ctx.term()


def test_manager_round_trip_over_sockets(tmp_path: Path) -> None:
    a_dir = _adapter_dir(tmp_path, "a")
    ipc = SimpleNamespace(tokenizer=f"ipc://{tmp_path}/tok", replica_scheduler=lambda r: f"ipc://{tmp_path}/s{r}")
    args = SimpleNamespace(lora_enabled=True, lora_paths={"a": a_dir}, dp_size=1, tokenizer_workers=0)
    ready = SchedulerReady(100, 8, 64, 32, "cpu", "torch_native", "cpu", "float32", [3], [])
    scheduler, seen = ScriptedScheduler(args.lora_paths), []

    async def run() -> None:
        manager = TokenizerManager(args, "/m", ipc, ready, [], None)
        stand_in = asyncio.ensure_future(_scheduler_stand_in(ipc, scheduler, seen))
        try:
            async def generate(lora: str | None) -> None:
                async for _ in manager.generate(GenerateRequest(input_ids=[1, 2], lora_path=lora,
                                                                sampling_params={"max_new_tokens": 1})):
                    pass

            await generate("a")
            await generate(a_dir)
            assert await manager.load_lora_adapter("b", _adapter_dir(tmp_path, "b")) == {"a": a_dir, "b": str(tmp_path / "b")}
            await generate("b")
            await generate(None)
            assert [m.lora_name for m in seen if isinstance(m, TokenizedGenerateReqInput)] == ["a", "a", "b", None]
            assert await manager.unload_lora_adapter("a") == {"b": str(tmp_path / "b")}
            with pytest.raises(RequestError, match="lora_path: LoRA adapter 'a' is not loaded; loaded: 'b'"):
                await generate("a")
            scheduler.silent = True
            with pytest.raises(asyncio.TimeoutError):
                await manager.load_lora_adapter("a", a_dir, timeout=0.2)
            scheduler.silent = False
            assert await manager.load_lora_adapter("a", a_dir) == {"a": a_dir, "b": str(tmp_path / "b")}
            assert not manager.control_waiters
        finally:
            stand_in.cancel()
            await asyncio.gather(stand_in, return_exceptions=True)
            await manager.close()

    asyncio.run(run())


def test_an_adapter_unloaded_after_model_was_read_is_named_as_model(client: TestClient,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # The route resolved ``model`` to an adapter that is gone by the time the manager checks it.
    monkeypatch.setattr(client.app.state.ctx, "resolve_model", lambda name: "gone")
    r = client.post("/v1/completions", json={"model": "gone", "prompt": [5], "max_tokens": 1})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "model" and error["message"].startswith(
        "model: LoRA adapter 'gone' is not loaded"), r.text
