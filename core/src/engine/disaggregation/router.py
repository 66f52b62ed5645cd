"""The prefill/decode router (``engine router --prefill URL --decode URL``).

Each request goes to one prefill server and one decode server at once, both bodies carrying
the same ``bootstrap_room`` and request ids, and ``bootstrap_host``/``bootstrap_port`` naming
the prefill server's KV transfer address. The client gets the decode server's answer
(streamed as it comes for ``"stream": true``); the prefill server's answer is read only for
its errors. Per kind, a router policy (``engine.router.RouterPolicy``, the plugin kind the
data-parallel router uses) picks the server from the requests each has in flight: by default
``shortest-queue``, the one with the fewest outstanding requests.

Failures end the request at once, never a hang: a prefill server that answers an error or
cannot be reached ends the request with that error and the decode half is cancelled (closing
its connection aborts it there, which frees its KV and its pending fetch); a decode server
that fails or goes away mid-stream ends the stream with an in-band error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from engine.router import RouterPolicy
from engine.router.router import Router

logger = logging.getLogger(__name__)

ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
_CONNECT_TIMEOUT_S = 5.0
#: ``engine router --policy``'s default: per kind, the server with the fewest requests in flight.
DEFAULT_POLICY = "shortest-queue"
KINDS = ("prefill", "decode")


class RouterError(Exception):
    """A request the router could not complete: its HTTP status and OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                               "param": param, "code": status}}


@dataclass
class PrefillServer:
    url: str
    bootstrap_port: int

    @property
    def bootstrap_host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"


@dataclass
class PDRouter:
    """Routing state: the servers of each kind, the policy choosing among them (one instance
    per kind, built by ``policy_factory(kind, num_servers)``; None: the plugin named ``policy``,
    and ``decode_policy`` for decode servers when given), the requests in flight on each server,
    and counts for ``/get_server_info``."""

    prefill: list[PrefillServer]
    decode: list[str]
    api_key: str | None = None
    policy: str = DEFAULT_POLICY
    decode_policy: str | None = None
    policy_factory: Callable[[str, int], RouterPolicy] | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"requests": 0, "prefill_failed": 0, "decode_failed": 0})

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("the router needs at least one --prefill and one --decode server")
        self.decode_policy = self.decode_policy or self.policy
        names = {"prefill": self.policy, "decode": self.decode_policy}
        make = self.policy_factory or (lambda kind, n: _plugin_policy(names[kind], n))
        sizes = {"prefill": len(self.prefill), "decode": len(self.decode)}
        # One server of a kind needs no choice (engine.router.Router then takes no policy).
        self._routers = {kind: Router(n, make(kind, n) if n > 1 else None, names[kind]) for kind, n in sizes.items()}

    def pair(self, key: str, prompt: list[int]) -> tuple[PrefillServer, str]:
        """The servers for one client request (``key``, unique among those in flight); both count
        it in flight until ``release(kind, key)``."""
        p = self._routers["prefill"].route(key, prompt).replica
        d = self._routers["decode"].route(key, prompt).replica
        return self.prefill[p], self.decode[d]

    def release(self, kind: str, key: str) -> None:
        """The ``kind`` half of request ``key`` ended (any way; repeated calls are ignored)."""
        self._routers[kind].finish(key)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def bodies(self, path: str, body: dict[str, Any], prefill: PrefillServer) -> tuple[dict[str, Any], dict[str, Any]]:
        """The prefill and decode servers' bodies for one client request."""
        if not isinstance(body, dict):
            raise RouterError(400, "the request body must be a JSON object")
        room = random.getrandbits(63)
        rid = body.get("rid")
        if rid is None:
            base = uuid.uuid4().hex
            batch = _batch_size(body) if path == "/generate" else None
            rid = [f"{base}-{i}" for i in range(batch)] if batch is not None else base
        shared = {**body, "rid": rid, "bootstrap_room": room, "bootstrap_host": prefill.bootstrap_host,
                  "bootstrap_port": prefill.bootstrap_port}
        prefill_body = {k: v for k, v in shared.items() if k != "stream_options"}
        prefill_body["stream"] = False
        return prefill_body, shared

    def stats(self) -> dict[str, Any]:
        loads = {kind: [{"url": url, **{k: v for k, v in row.items() if k != "index"}}
                        for url, row in zip(self._urls(kind), self._routers[kind].stats()["replicas"], strict=True)]
                 for kind in KINDS}
        return {"prefill": [p.url for p in self.prefill], "decode": list(self.decode), "policy": self.policy,
                "decode_policy": self.decode_policy,
                "servers": loads, **self.counts}

    def _urls(self, kind: str) -> list[str]:
        return [p.url for p in self.prefill] if kind == "prefill" else list(self.decode)


def _plugin_policy(name: str, num_servers: int) -> RouterPolicy:
    import engine.plugins as plugins

    return plugins.create_router_policy(name, num_servers)  # type: ignore[no-any-return]


def prompt_key(path: str, body: dict[str, Any]) -> list[int]:
    """What a policy sees as the request's prompt: its token ids when the body gives ids, else
    the UTF-8 bytes of its text (the router has no tokenizer; a cache-aware policy then matches
    prefixes of text, as SGLang's router does). A batch is keyed by its first prompt."""
    if path == "/generate":
        ids, text = body.get("input_ids"), body.get("text")
        prompt: Any = ids if ids is not None else text
    elif path == "/v1/completions":
        prompt = body.get("prompt")
    else:
        prompt = json.dumps(body.get("messages"), ensure_ascii=False, separators=(",", ":"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(prompt.encode())
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return []


def _batch_size(body: dict[str, Any]) -> int | None:
    """How many prompts a /generate body holds (None: one prompt, not a batch)."""
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def _failure(kind: str, url: str, exc: BaseException) -> RouterError:
    return RouterError(502, f"the {kind} server {url} failed: {type(exc).__name__}: {exc}".rstrip(": "))


def _sse(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


async def _prefill_outcome(client: Any, router: PDRouter, server: PrefillServer, path: str,
                           body: dict[str, Any]) -> RouterError | None:
    """None when the prefill server did its part, else the error to give the client."""
    try:
        r = await client.post(server.url + path, json=body, headers=router.headers())
    except Exception as exc:  # noqa: BLE001 - any transport failure is the prefill server's
        router.counts["prefill_failed"] += 1
        return _failure("prefill", server.url, exc)
    if r.status_code >= 400:
        router.counts["prefill_failed"] += 1
        err = RouterError(r.status_code, f"the prefill server {server.url} answered {r.status_code}")
        try:
            err.body = r.json()
        except ValueError:
            pass
        return err
    return None


async def route(client: Any, router: PDRouter, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """Runs one request; returns (status, JSON body) or, for a stream, (200, an async iterator
    of SSE bytes)."""
    if not isinstance(body, dict):
        raise RouterError(400, "the request body must be a JSON object")
    key = uuid.uuid4().hex
    prefill, decode = router.pair(key, prompt_key(path, body))
    try:
        prefill_body, decode_body = router.bodies(path, body, prefill)
    except BaseException:
        router.release("prefill", key)
        router.release("decode", key)
        raise
    router.counts["requests"] += 1
    prefill_task = asyncio.ensure_future(_prefill_outcome(client, router, prefill, path, prefill_body))
    prefill_task.add_done_callback(lambda _: router.release("prefill", key))
    request = client.build_request("POST", decode + path, json=decode_body, headers=router.headers())
    decode_task = asyncio.ensure_future(client.send(request, stream=True))
    decode_done = lambda: router.release("decode", key)  # noqa: E731
    try:
        done, _ = await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
        if prefill_task in done and prefill_task.result() is not None:
            raise prefill_task.result()
        try:
            response = await decode_task
        except Exception as exc:  # noqa: BLE001
            router.counts["decode_failed"] += 1
            raise _failure("decode", decode, exc) from None
    except BaseException:
        decode_done()
        prefill_task.cancel()
        decode_task.cancel()
        if decode_task.done() and not decode_task.cancelled() and decode_task.exception() is None:
            await decode_task.result().aclose()
        raise
    if response.status_code >= 400 or not decode_body.get("stream"):
        try:
            data = await _read_json(response, prefill_task, decode)
        except BaseException:
            prefill_task.cancel()
            raise
        finally:
            decode_done()
        if response.status_code >= 400:
            prefill_task.cancel()
        return response.status_code, data
    # A stream's decode half ends with its relay, or when the response is dropped unread.
    weakref.finalize(response, decode_done)
    return 200, _relay(router, response, prefill_task, decode, decode_done)


async def _read_json(response: Any, prefill_task: asyncio.Future[Any], decode: str) -> Any:
    """The decode server's whole answer, unless the prefill half fails first."""
    read = asyncio.ensure_future(response.aread())
    try:
        while True:
            done, _ = await asyncio.wait({read, prefill_task} - ({prefill_task} if prefill_task.done() else set()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if prefill_task in done and prefill_task.result() is not None:
                raise prefill_task.result()
            if read in done:
                try:
                    raw = read.result()
                except Exception as exc:  # noqa: BLE001
                    raise _failure("decode", decode, exc) from None
                try:
                    return json.loads(raw)
                except ValueError:
                    raise RouterError(502, f"the decode server {decode} answered no JSON") from None
    finally:
        read.cancel()
        await response.aclose()


async def _relay(router: PDRouter, response: Any, prefill_task: asyncio.Future[Any], decode: str,
                 release: Callable[[], None]) -> AsyncIterator[bytes]:
    """The decode server's SSE bytes; an in-band error event when either half fails."""
    chunks = response.aiter_raw()
    step: asyncio.Future[bytes] | None = None
    try:
        while True:
            if step is None:
                step = asyncio.ensure_future(chunks.__anext__())
            waiting = {step} if prefill_task.done() else {step, prefill_task}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task in done and prefill_task.result() is not None:
                yield _sse(prefill_task.result().body)
                return
            if step not in done:
                continue  # the prefill half succeeded; the chunk is still coming
            finished, step = step, None
            try:
                chunk = finished.result()
            except StopAsyncIteration:
                return
            except Exception as exc:  # noqa: BLE001 - the decode server went away mid-stream
                router.counts["decode_failed"] += 1
                yield _sse(_failure("decode", decode, exc).body)
                return
            yield chunk
    finally:
        release()
        if step is not None:
            step.cancel()
        prefill_task.cancel()
        await response.aclose()
