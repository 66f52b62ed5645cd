"""``Engine(...)``: programs on an in-process engine (``engine.Engine``), no server.

``Engine(**server_args)`` starts an engine it owns (``close()`` shuts it down);
``Engine(engine=existing)`` wraps one the caller made. While the backend holds an engine, the
engine's event loop runs in a background thread so that a program's forks and a batch's programs
run concurrently: call the engine through the backend until ``close()``, which hands the loop back.
``engine`` (plugserve-core) is imported only here, when the backend is created.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator
from typing import Any

from engine_lang.backends.base import BackendError, RequestAborted, UnsupportedOperation
from engine_lang.backends.native import NativeBackend
from engine_lang.chat_template import ChatTemplate

_END = object()


def _per_prompt(value: Any, count: int, default: Any) -> list[Any]:
    if isinstance(value, list):
        return [default if v is None else v for v in value]
    return [default if value is None else value] * count


class Engine(NativeBackend):
    name = "engine"

    def __init__(self, engine: Any = None, **server_args: Any) -> None:
        super().__init__()
        self._owns = engine is None
        if engine is None:
            from engine import Engine as RuntimeEngine

            engine = RuntimeEngine(**server_args)
        elif server_args:
            raise TypeError(f"Engine(engine=...): server arguments {sorted(server_args)} apply only to an engine this "
                            "backend starts")
        self.engine = engine
        self._manager = engine.tokenizer_manager
        self._loop: asyncio.AbstractEventLoop = engine.loop
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-lang-engine-loop", daemon=True)
        self._thread.start()
        self._closed = False

    # -- native bodies onto the tokenizer manager ------------------------------------------------
    def _requests(self, body: dict[str, Any], stream: bool) -> tuple[list[Any], bool]:
        from engine.managers.tokenizer_manager import GenerateRequest

        batch = isinstance(body["text"], list)
        texts = body["text"] if batch else [body["text"]]
        n = len(texts)
        rids = body.get("rid") if isinstance(body.get("rid"), list) else [body.get("rid")] * n
        want = _per_prompt(body.get("return_logprob"), n, False)
        start = _per_prompt(body.get("logprob_start_len"), n, -1)
        top = _per_prompt(body.get("top_logprobs_num"), n, 0)
        reqs = [GenerateRequest(text=texts[i], sampling_params=dict(body.get("sampling_params") or {}), rid=rids[i],
                                return_logprob=want[i], logprob_start_len=start[i], top_logprobs_num=top[i],
                                stream=stream) for i in range(n)]
        return reqs, batch

    def _output(self, out: dict[str, Any]) -> dict[str, Any]:
        meta = dict(out["meta_info"])
        decode = self.engine.tokenizer.decode
        for key in ("input_token_logprobs", "output_token_logprobs"):
            if meta.get(key) is not None:
                meta[key] = [[lp, tid, decode([tid])] for lp, tid in meta[key]]
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            raise RequestAborted(f"the engine aborted request {meta.get('id')}: {reason.get('message', '')}")
        return {"text": out["text"], "output_ids": out["output_ids"], "meta_info": meta}

    async def _one(self, req: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async for item in self._manager.generate(req):
            out = item  # the last output is the final one
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("the Engine backend is closed")

    def _call(self, body: dict[str, Any]) -> Any:
        self._check_open()
        reqs, batch = self._requests(body, False)

        async def run_all() -> list[dict[str, Any]]:
            return list(await asyncio.gather(*(self._one(r) for r in reqs)))

        try:
            outs = asyncio.run_coroutine_threadsafe(run_all(), self._loop).result()
        except RequestAborted:
            raise
        except Exception as exc:
            raise BackendError(f"the engine refused the request: {exc}") from exc
        results = [self._output(o) for o in outs]
        return results if batch else results[0]

    def _stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        self._check_open()
        (req,), _ = self._requests(body, True)
        events: queue.Queue[Any] = queue.Queue()

        async def pump() -> None:
            try:
                async for out in self._manager.generate(req):
                    events.put(out)
            except Exception as exc:  # noqa: BLE001 - handed to the reading thread
                events.put(exc)
            finally:
                events.put(_END)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := events.get()) is not _END:
                if isinstance(item, Exception):
                    raise BackendError(f"the engine failed the request: {item}") from item
                yield self._output(item)
        finally:
            future.cancel()  # a reader that stops early: closing the generator aborts the request

    def _abort_one(self, rid: str) -> None:
        if not self._closed:
            self._loop.call_soon_threadsafe(self._manager.abort, rid)

    def chat_template(self) -> ChatTemplate:
        tokenizer = self.engine.tokenizer
        source = getattr(tokenizer, "chat_template", None)
        if not source:
            raise UnsupportedOperation("chat roles (system/user/assistant): the engine's model has no chat template")
        special = getattr(tokenizer, "special_tokens_map", None) or {}
        return ChatTemplate(source, {k: v for k, v in special.items() if isinstance(v, str)})

    def get_server_info(self) -> dict[str, Any]:
        reply = asyncio.run_coroutine_threadsafe(self._manager.control("server_info"), self._loop).result()
        return dict(reply.data)

    def close(self) -> None:
        """Hands the event loop back to the engine; shuts the engine down if this backend started it."""
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if self._owns:
            self.engine.shutdown()

    def __repr__(self) -> str:
        return f"Engine({self.engine.server_args.model_path or 'the default model'!r})"
