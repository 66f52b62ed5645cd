"""``OpenAI(model, base_url=...)``: programs on any server that speaks OpenAI's ``/v1/completions``
and ``/v1/chat/completions``.

A ``gen`` that opens an assistant message is sent to ``/chat/completions`` with the messages so
far (the server applies its own chat template); every other ``gen`` sends the program's text to
``/completions``. ``select`` scores the choices with one ``/completions`` request using ``echo``
and ``logprobs`` (the prompt's token logprobs), which this engine, SGLang and vLLM return;
a server that does not answers with an ``UnsupportedOperation`` naming ``select``.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import httpx

from engine_lang.backends.base import (
    Backend,
    BackendError,
    GenOutput,
    GenRequest,
    RequestAborted,
    ScoreOutput,
    ScoreRequest,
    UnsupportedOperation,
)
from engine_lang.chat_template import CHATML_TEMPLATE, ChatTemplate
from engine_lang.choices import ChoiceLogprobs

# Native sampling names -> OpenAI's; the SGLang extras go as extra fields (this engine, SGLang and
# vLLM accept them), and only when they differ from the default, so plain OpenAI servers never see them.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "stop": "stop",
                 "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty", "seed": "seed"}
_EXTRA_DEFAULTS = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0, "ignore_eos": False,
                   "stop_token_ids": None, "regex": None, "ebnf": None}
_EXTRA_NAMES = {"min_new_tokens": "min_tokens"}


class _Refused(BackendError):
    """The server answered the request with an error status (a 4xx: it does not accept it)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class OpenAI(Backend):
    """``model_name``: the served model (default: the first of ``/models``); ``base_url`` and
    ``api_key`` default to ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``. ``chat_template`` renders
    ``s.text()`` of chat programs; by default the server's own when it is this engine (its
    ``/get_model_info``), else ChatML."""

    name = "openai"

    def __init__(self, model_name: str | None = None, base_url: str | None = None, api_key: str | None = None,
                 chat_template: str | ChatTemplate | None = None, is_chat_model: bool = True,
                 timeout: float = 600.0) -> None:
        self.base_url = (base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1").rstrip("/")
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.Client(headers=headers, timeout=timeout,
                                    limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self.is_chat_model = is_chat_model
        self.model_name = model_name or self._first_model()
        self._template_arg = chat_template
        self._template: ChatTemplate | None = None
        self._open: dict[str, httpx.Response] = {}
        # Requests abort() closed: their connection error is reported as an abort.
        self._aborted: set[str] = set()
        self._lock = threading.Lock()

    def _first_model(self) -> str:
        try:
            r = self._client.get(self.base_url + "/models")
            r.raise_for_status()
            return str(r.json()["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise BackendError(f"OpenAI: no model_name given and {self.base_url}/models did not name one: {exc}") from None

    # -- requests ------------------------------------------------------------------------------
    def _fields(self, params: dict[str, Any], op: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model_name}
        for name, value in params.items():
            if name in _OPENAI_NAMES:
                body[_OPENAI_NAMES[name]] = value
            elif name in _EXTRA_DEFAULTS:
                if value != _EXTRA_DEFAULTS[name]:
                    body[_EXTRA_NAMES.get(name, name)] = value
            elif name == "json_schema":
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "output", "schema": json.loads(value)}}
            else:
                raise UnsupportedOperation(f"{op}: sampling parameter {name!r} has no OpenAI API equivalent")
        return body

    def _post(self, path: str, body: dict[str, Any], rid: str) -> Iterator[dict[str, Any]]:
        """POSTs and yields the JSON body, or each SSE event when ``body["stream"]``; abort(rid)
        closes the connection (this engine and SGLang abort a request whose client left)."""
        try:
            with self._client.stream("POST", self.base_url + path, json=body) as r:
                with self._lock:
                    self._open[rid] = r
                try:
                    if r.status_code != 200:
                        r.read()
                        raise self._error(path, r)
                    if not body.get("stream"):
                        yield json.loads(r.read())
                        return
                    for line in r.iter_lines():
                        if line.startswith("data:") and line[5:].strip() != "[DONE]":
                            event = json.loads(line[5:])
                            if "error" in event:
                                raise BackendError(f"{path}: {event['error'].get('message', event['error'])}")
                            yield event
                finally:
                    with self._lock:
                        self._open.pop(rid, None)
        except (httpx.HTTPError, RuntimeError) as exc:
            if isinstance(exc, BackendError):
                raise
            with self._lock:
                aborted = rid in self._aborted
                self._aborted.discard(rid)
            if aborted:
                raise RequestAborted(f"{path}: the request was aborted") from None
            raise BackendError(f"{self.base_url}{path} failed: {exc}") from None

    def _one(self, path: str, body: dict[str, Any], rid: str) -> dict[str, Any]:
        """A request answered by one JSON body; the connection is released before returning."""
        with closing(self._post(path, body, rid)) as replies:
            return next(replies)

    @staticmethod
    def _error(path: str, r: httpx.Response) -> BackendError:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:500]
        return _Refused(f"{path} answered {r.status_code}: {message}", r.status_code)

    def _request(self, req: GenRequest, stream: bool) -> tuple[str, dict[str, Any]]:
        if req.logprobs.get("return_logprob"):
            raise UnsupportedOperation("gen(return_logprob=True): the openai backend does not return logprobs")
        if req.messages is not None and self.is_chat_model:
            body = {**self._fields(req.sampling_params, "gen"), "messages": req.messages}
            path = "/chat/completions"
        else:
            body = {**self._fields(req.sampling_params, "gen"), "prompt": req.text}
            path = "/completions"
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return path, body

    @staticmethod
    def _meta(out: dict[str, Any], finish: str | None) -> dict[str, Any]:
        usage = out.get("usage") or {}
        return {"id": out.get("id"), "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                "finish_reason": {"type": finish}}

    def generate(self, req: GenRequest) -> GenOutput:
        path, body = self._request(req, False)
        out = self._one(path, body, req.rid)
        choice = out["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return GenOutput(text or "", self._meta(out, choice.get("finish_reason")))

    def generate_stream(self, req: GenRequest) -> Iterator[GenOutput]:
        path, body = self._request(req, True)
        text, finish, last = "", None, {}
        for event in self._post(path, body, req.rid):
            last = event
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                text += piece or ""
                finish = choice.get("finish_reason") or finish
                yield GenOutput(text, self._meta(event, finish))
        yield GenOutput(text, self._meta(last, finish))

    def score(self, req: ScoreRequest) -> ScoreOutput:
        prompts = [req.prefix + c for c in req.choices] + (list(req.choices) if req.unconditional else [])
        body = {"model": self.model_name, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
                "temperature": 0}
        try:
            out = self._one("/completions", body, req.rid)
            rows = sorted(out["choices"], key=lambda c: c["index"])
            logprobs = [row["logprobs"] for row in rows]
            if any(lp is None or not lp.get("token_logprobs") for lp in logprobs):
                raise KeyError("logprobs")
        except (_Refused, KeyError, TypeError) as exc:
            if isinstance(exc, _Refused) and exc.status >= 500:
                raise
            raise UnsupportedOperation(f"select: the OpenAI-compatible server at {self.base_url} does not return prompt "
                                       f"logprobs (/completions with echo and logprobs), which select needs: {exc}") from None
        n = len(req.choices)
        choices = []
        for i in range(n):
            tokens = _span(logprobs[i], len(req.prefix), len(prompts[i]))
            uncond = [t[0] for t in _span(logprobs[n + i], 0, len(req.choices[i]))] if req.unconditional else None
            choices.append(ChoiceLogprobs(tokens, uncond))
        usage = out.get("usage") or {}
        return ScoreOutput(choices, {"cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)})

    def abort(self, rid: str) -> None:
        with self._lock:
            response = self._open.get(rid)
            if response is not None:
                self._aborted.add(rid)
        if response is not None:
            response.close()

    # -- chat ------------------------------------------------------------------------------------
    def chat_template(self) -> ChatTemplate:
        if self._template is None:
            arg = self._template_arg
            if isinstance(arg, ChatTemplate):
                self._template = arg
            elif isinstance(arg, str):
                self._template = ChatTemplate(arg)
            else:
                self._template = self._server_template() or ChatTemplate(CHATML_TEMPLATE)
        return self._template

    def _server_template(self) -> ChatTemplate | None:
        root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        try:
            r = self._client.get(root + "/get_model_info", timeout=10)
            info = r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return None
        source = info.get("chat_template") if isinstance(info, dict) else None
        return ChatTemplate(source, dict(info.get("special_tokens") or {})) if source else None

    def close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"OpenAI({self.model_name!r}, base_url={self.base_url!r})"


def _span(logprobs: dict[str, Any], start: int, end: int) -> list[list[Any]]:
    """The echoed prompt tokens covering characters [start, end) of the prompt, as
    [logprob, None, text]: a token that straddles ``start`` belongs to the span (token healing)."""
    out = []
    for token, lp, offset in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["text_offset"], strict=True):
        if offset >= end:
            break  # the generated token and beyond
        if offset + len(token) > start:
            out.append([lp, None, token])
    return out
