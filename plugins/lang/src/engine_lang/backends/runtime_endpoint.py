"""``RuntimeEndpoint(url)``: programs on ``engine serve`` (or SGLang) through the native API:
``/generate``, ``/abort_request`` and ``/get_model_info`` (for the chat template)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cached_property
from typing import Any

import httpx

from engine_lang.backends.base import BackendError, RequestAborted, UnsupportedOperation
from engine_lang.backends.native import NativeBackend
from engine_lang.chat_template import ChatTemplate


def _error_message(body: Any, status: int) -> tuple[str, str | None]:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message")), body["error"].get("code")
    return f"HTTP {status}: {str(body)[:500]}", None


class RuntimeEndpoint(NativeBackend):
    """A running server at ``base_url`` (``http://127.0.0.1:30000``); ``api_key`` if it sets one."""

    name = "runtime"

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # One pooled client, shared by every thread of every program (httpx.Client is thread-safe).
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout,
                                    limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self.model_info = self._get("/get_model_info")

    def _get(self, path: str) -> dict[str, Any]:
        try:
            r = self._client.get(path)
        except httpx.HTTPError as exc:
            raise BackendError(f"RuntimeEndpoint: cannot reach {self.base_url}{path}: {exc}") from None
        if r.status_code != 200:
            message, _ = _error_message(self._json(r), r.status_code)
            raise BackendError(f"RuntimeEndpoint: {self.base_url}{path} answered {r.status_code}: {message}")
        return r.json()

    @staticmethod
    def _json(r: httpx.Response) -> Any:
        try:
            return r.json()
        except ValueError:
            return r.text

    def _raise(self, body: Any, status: int) -> None:
        message, code = _error_message(body, status)
        error = RequestAborted if code == "request_aborted" else BackendError
        raise error(f"/generate answered {status}: {message}")

    def _call(self, body: dict[str, Any]) -> Any:
        try:
            r = self._client.post("/generate", json=body)
        except httpx.HTTPError as exc:
            raise BackendError(f"/generate at {self.base_url} failed: {exc}") from None
        if r.status_code != 200:
            self._raise(self._json(r), r.status_code)
        return r.json()

    def _stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        try:
            with self._client.stream("POST", "/generate", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    self._raise(self._json(r), r.status_code)
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        self._raise(event, 200)
                    yield event
        except httpx.HTTPError as exc:
            raise BackendError(f"/generate at {self.base_url} failed while streaming: {exc}") from None

    def _abort_one(self, rid: str) -> None:
        try:
            self._client.post("/abort_request", json={"rid": rid}, timeout=10)
        except httpx.HTTPError:
            pass  # the server is gone: nothing runs there any more

    @cached_property
    def _template(self) -> ChatTemplate:
        source = self.model_info.get("chat_template")
        if not source:
            raise UnsupportedOperation(f"chat roles (system/user/assistant): the server at {self.base_url} reports no "
                                       "chat template for its model (/get_model_info chat_template); use plain "
                                       "text, or a model with a chat template")
        return ChatTemplate(source, dict(self.model_info.get("special_tokens") or {}))

    def chat_template(self) -> ChatTemplate:
        return self._template

    def get_server_info(self) -> dict[str, Any]:
        return self._get("/get_server_info")

    def flush_cache(self) -> None:
        r = self._client.post("/flush_cache")
        if r.status_code != 200:
            message, _ = _error_message(self._json(r), r.status_code)
            raise BackendError(f"/flush_cache answered {r.status_code}: {message}")

    def close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"
