"""HTTP request functions for each ``--backend`` of ``engine bench serving``.

A backend is a path, a payload builder and a parser from one response JSON (an SSE event
or a whole non-streamed body) to a ``ResponseUpdate``; ``send_request`` is the single
timing loop shared by all of them, so TTFT/ITL mean the same thing for every backend.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.bench.requests import BenchRequest, TokenizerLike
from engine.bench.metrics import RequestResult

if TYPE_CHECKING:
    import httpx


@dataclass(frozen=True)
class ResponseUpdate:
    """What one response JSON says about the generation so far."""

    # Generated text carried by this update.
    text: str
    # True when ``text`` is everything generated so far (native /generate), False for a delta.
    cumulative: bool
    # Server's count of generated tokens so far, when it reports one.
    completion_tokens: int | None
    # Error reported in-band (an SSE event with "error"); fails the request.
    error: str | None = None
    # Server's count of prompt tokens, when it reports one (what an image costs is known there only).
    prompt_tokens: int | None = None
    # Running count of generated tokens, when the response carries one (native /generate:
    # its ``output_ids``). New tokens are timed by this count, not by text: a server started
    # with --skip-tokenizer-init streams ids with empty text, and a partial character's bytes
    # are held back, so text can lag the tokens or never come.
    tokens_so_far: int | None = None


@dataclass(frozen=True)
class RequestOptions:
    """Per-run settings every request of a run shares."""

    model: str | None
    stream: bool
    ignore_eos: bool
    extra_body: dict[str, Any]
    headers: dict[str, str]
    # Structured output: the JSON Schema (JSON text) every request follows, or None.
    json_schema: str | None = None
    # Each request gets its own copy (a distinct title), so the server compiles each.
    json_schema_unique: bool = False


_schema_copies = itertools.count()


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """The bearer-token header for ``api_key`` (None: the ``OPENAI_API_KEY`` environment
    variable); no header where neither is set."""
    key = api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _schema(opts: RequestOptions) -> str | None:
    if opts.json_schema is None or not opts.json_schema_unique:
        return opts.json_schema
    schema = json.loads(opts.json_schema)
    schema["title"] = f"bench-{next(_schema_copies)}"
    return json.dumps(schema)


@dataclass(frozen=True)
class Backend:
    """How to talk to one server API."""

    path: str
    build_payload: Callable[[BenchRequest, RequestOptions], dict[str, Any]]
    parse: Callable[[dict[str, Any]], ResponseUpdate]
    # Chat APIs take messages, so they cannot send token-id prompts.
    accepts_token_ids: bool = True
    # OpenAI APIs route by model name; the native /generate serves the one loaded model.
    needs_model: bool = True


def _native_payload(req: BenchRequest, opts: RequestOptions) -> dict[str, Any]:
    prompt_key = "text" if isinstance(req.prompt, str) else "input_ids"
    sampling = {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": opts.ignore_eos}
    schema = _schema(opts)
    if schema is not None:
        sampling["json_schema"] = schema
    lora = {"lora_path": req.lora_name} if req.lora_name is not None else {}
    return {
        prompt_key: req.prompt,
        "sampling_params": sampling,
        "stream": opts.stream,
        **lora,
        **opts.extra_body,
    }


def _native_parse(data: dict[str, Any]) -> ResponseUpdate:
    meta = data.get("meta_info") or {}
    ids = data.get("output_ids")
    return ResponseUpdate(
        text=data.get("text") or "",
        cumulative=True,
        completion_tokens=meta.get("completion_tokens"),
        error=_error_text(data),
        prompt_tokens=meta.get("prompt_tokens"),
        # Every event of a /generate stream is cumulative: its output_ids (or, from servers
        # that omit them, meta_info.completion_tokens) count all tokens so far.
        tokens_so_far=len(ids) if isinstance(ids, list) else meta.get("completion_tokens"),
    )


def _openai_common(req: BenchRequest, opts: RequestOptions) -> dict[str, Any]:
    payload: dict[str, Any] = {
        # An adapter is selected by its name in place of the model's (docs/lora.md).
        "model": req.lora_name if req.lora_name is not None else opts.model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": opts.stream,
        # Not in OpenAI's API; vLLM and SGLang read it so every request runs to max_tokens.
        "ignore_eos": opts.ignore_eos,
    }
    if opts.stream:
        # The final chunk then carries usage.completion_tokens: exact output lengths.
        payload["stream_options"] = {"include_usage": True}
    schema = _schema(opts)
    if schema is not None:
        payload["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": "bench", "schema": json.loads(schema)}}
    return payload


def _completions_payload(req: BenchRequest, opts: RequestOptions) -> dict[str, Any]:
    return {**_openai_common(req, opts), "prompt": req.prompt, **opts.extra_body}


def _chat_payload(req: BenchRequest, opts: RequestOptions) -> dict[str, Any]:
    content: Any = req.prompt
    if req.images:
        content = [*({"type": "image_url", "image_url": {"url": url}} for url in req.images),
                   {"type": "text", "text": req.prompt}]
    messages = [{"role": "user", "content": content}]
    return {**_openai_common(req, opts), "messages": messages, **opts.extra_body}


def _openai_parse(data: dict[str, Any]) -> ResponseUpdate:
    text = ""
    choices = data.get("choices") or []
    if choices:
        choice = choices[0]
        # Completions put text in "text"; chat chunks in delta.content, chat bodies in message.
        part = choice.get("delta") or choice.get("message") or {}
        text = choice.get("text") or part.get("content") or ""
    usage = data.get("usage") or {}
    return ResponseUpdate(
        text=text,
        cumulative=False,
        completion_tokens=usage.get("completion_tokens"),
        error=_error_text(data),
        prompt_tokens=usage.get("prompt_tokens"),
    )


def _error_text(data: dict[str, Any]) -> str | None:
    error = data.get("error")
    if not error:
        return None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


_NATIVE = Backend("/generate", _native_payload, _native_parse, needs_model=False)
_COMPLETIONS = Backend("/v1/completions", _completions_payload, _openai_parse)
BACKENDS: dict[str, Backend] = {
    "engine": _NATIVE,
    "sglang": _NATIVE,
    "openai": _COMPLETIONS,
    "vllm": _COMPLETIONS,
    "openai-chat": Backend(
        "/v1/chat/completions", _chat_payload, _openai_parse, accepts_token_ids=False
    ),
}


class _StreamState:
    """Accumulates one response's text and token timing as updates arrive."""

    def __init__(self, start: float) -> None:
        self.text = ""
        self.first_token_at: float | None = None
        self.last_token_at = start
        self.tokens_seen = 0
        self.reported_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.itl: list[float] = []
        self.chunks = 0

    def add(self, update: ResponseUpdate, now: float) -> None:
        if update.completion_tokens is not None:
            self.reported_tokens = update.completion_tokens
        if update.prompt_tokens is not None:
            self.prompt_tokens = update.prompt_tokens
        if update.cumulative:
            text_grew = len(update.text) > len(self.text)
            self.text = update.text if text_grew else self.text
        else:
            text_grew = bool(update.text)
            self.text += update.text
        if update.tokens_so_far is not None:
            new_tokens = update.tokens_so_far - self.tokens_seen
            if new_tokens <= 0:
                return  # a repeated count (e.g. the finish event) carries no new token
            self.chunks += 1
        elif text_grew:
            self.chunks += 1
            # Deltas with no running count: the last usage figure, else one token per chunk.
            count = self.reported_tokens if self.reported_tokens is not None else self.chunks
            new_tokens = max(count - self.tokens_seen, 1)
        else:
            return  # usage-only chunks and held-back partial characters carry no token timing
        # A chunk may carry several tokens (server-side batching of the stream); spread its
        # gap over them so ITL stays per token, as SGLang does for /generate.
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self.itl.extend([(now - self.last_token_at) / new_tokens] * new_tokens)
        self.tokens_seen += new_tokens
        self.last_token_at = now


async def send_request(
    client: httpx.AsyncClient,
    base_url: str,
    backend: Backend,
    req: BenchRequest,
    opts: RequestOptions,
    tokenizer: TokenizerLike | None = None,
) -> RequestResult:
    """Send one request and time it; any failure is returned in the result, never raised.

    Output length is the server's reported completion tokens when present, else the
    tokenizer's count of the generated text, else the number of text chunks when streaming
    (the requested ``output_len`` when not: one body says nothing about token counts).
    """
    result = RequestResult(prompt_len=req.prompt_len)
    payload = backend.build_payload(req, opts)
    start = time.perf_counter()
    result.start_time = start
    progress = _StreamState(start)
    try:
        async with client.stream(
            "POST", base_url + backend.path, json=payload, headers=opts.headers
        ) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            if opts.stream:
                async for line in response.aiter_lines():
                    # SSE: only "data:" lines matter; blank lines and ": keep-alive" do not.
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        break
                    update = backend.parse(json.loads(data))
                    if update.error:
                        result.error = f"server error: {update.error}"
                        return result
                    progress.add(update, time.perf_counter())
            else:
                update = backend.parse(json.loads(await response.aread()))
                if update.error:
                    result.error = f"server error: {update.error}"
                    return result
                progress.add(update, time.perf_counter())
    except Exception as exc:  # noqa: BLE001 - a benchmark records failures instead of stopping
        result.error = f"{type(exc).__name__}: {exc}"
        return result

    end = time.perf_counter()
    result.success = True
    result.latency = end - start
    result.generated_text = progress.text
    # Without any token there is no first token; TTFT is then the whole wait.
    result.ttft = (progress.first_token_at or end) - start
    result.itl = progress.itl
    if req.images and progress.prompt_tokens is not None:
        # The client cannot count an image's tokens: the server's count is the prompt's length.
        result.prompt_len = progress.prompt_tokens
    if progress.reported_tokens is not None:
        result.output_len = progress.reported_tokens
    elif tokenizer is not None:
        result.output_len = len(tokenizer.encode(progress.text, add_special_tokens=False))
    elif opts.stream:
        result.output_len = progress.chunks
    else:
        result.output_len = req.output_len
    return result
