"""Running one HTTP request's generations on the tokenizer manager, shared by every route.

A request becomes a list of ``Choice`` (one per prompt and per ``n`` copy), all
validated before any is sent, so a bad element fails the whole request with a
400 and nothing runs. Non-streamed requests wait for every choice and are
aborted if the client goes away; streamed ones merge the choices' outputs as
they come. Closing a stream (the client disconnected) closes every manager
generator, which sends the scheduler an abort so the request's KV is freed.

An aborted choice ends with finish reason ``abort`` (SGLang's ``{"type": "abort"}`` in
``meta_info``) and the response with an error; the other choices of a stream run on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.responses import StreamingResponse

from engine.entrypoints.http.errors import APIError, engine_dead_error, from_request_error, shutting_down_error
from engine.entrypoints.http.jsonenc import encode_json
from engine.managers.tokenizer_manager import (
    EngineDeadError,
    GenerateRequest,
    RequestError,
    ServerShuttingDownError,
)

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.types import Receive, Scope, Send

    from engine.entrypoints.http.context import ServingContext
    from engine.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class Choice:
    """One generation of a response: a prompt, possibly one of ``n`` copies."""

    # Position in the response's ``choices`` (prompt_index * n + copy).
    index: int
    # Which prompt of the request it answers (usage counts each prompt once).
    prompt_index: int
    request: GenerateRequest
    # Token ids and validated sampling params from TokenizerManager.prepare.
    prepared: tuple[list[int], SamplingParams]
    # Set by ``start_requests``: the request already sent (a RequestStream), or why sending it or a
    # choice before it failed (then it is not sent).
    started: Any = None
    start_error: BaseException | None = None

    @property
    def prompt_ids(self) -> list[int]:
        return self.prepared[0]


async def make_choices(ctx: ServingContext, prompts: Sequence[GenerateRequest], n: int | Sequence[int],
                       renames: dict[str, str] | None = None, group_rid: str | None = None) -> list[Choice]:
    """Expands prompts into ``n`` copies each (seed + copy, as the offline Engine does) and
    validates them all; a RequestError becomes a 400 with the API's field names.

    ``n`` is one count for every prompt or a count per prompt. Texts are tokenized on the
    tokenizer pool. A prompt's rid with ``n > 1``, and ``group_rid`` (the request's own id
    when its prompts got derived ids), become group ids ``/abort_request`` accepts.
    """
    ctx.check_accepting()
    counts = [n] * len(prompts) if isinstance(n, int) else list(n)
    choices: list[Choice] = []
    seen: set[str] = set()
    groups: dict[str, list[str]] = {}
    for p, base in enumerate(prompts):
        seed = base.sampling_params.get("seed")
        n = counts[p]
        for copy in range(n):
            params = dict(base.sampling_params)
            if n > 1 and seed is not None:
                params["seed"] = seed + copy  # distinct but reproducible samples
            rid = base.rid if base.rid is None or n == 1 else f"{base.rid}-{copy}"
            req = dataclasses.replace(base, sampling_params=params, rid=rid)
            if rid is not None:
                _check_rid_free(ctx, rid, seen)
                seen.add(rid)
                if n > 1 and base.rid is not None:
                    groups.setdefault(base.rid, []).append(rid)
                if group_rid is not None and group_rid != rid:
                    groups.setdefault(group_rid, []).append(rid)
            try:
                prepared = await ctx.manager.prepare_async(req)
            except RequestError as exc:
                raise from_request_error(exc, renames) from None
            choices.append(Choice(len(choices), p, req, prepared))
    for parent, rids in groups.items():
        if parent not in seen:
            _check_rid_free(ctx, parent, set())
        ctx.manager.add_group(parent, rids)
    ctx.check_accepting()  # the server may have begun draining while the prompts were tokenized
    return choices


def response_model(ctx: ServingContext, requested: str | None, lora: str | None) -> str:
    """The ``model`` a response names: the request's own when it selected a LoRA adapter (as
    vLLM answers), else the served model name."""
    return requested if lora is not None and requested is not None else ctx.model_name


def _check_rid_free(ctx: ServingContext, rid: str, seen: set[str]) -> None:
    if rid in seen or rid in ctx.manager.states or rid in ctx.manager.groups:
        raise APIError(400, f"rid: a request with id '{rid}' is already running", param="rid")


def finish_reason(meta: dict[str, Any]) -> str | None:
    """OpenAI's finish_reason; raises the APIError for an aborted request."""
    reason = stream_finish_reason(meta)
    if reason == "abort":
        raise aborted_error([meta])
    return reason


def stream_finish_reason(meta: dict[str, Any]) -> str | None:
    """OpenAI's finish_reason, ``abort`` for an aborted choice (SGLang's name)."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type")
    if kind == "abort":
        return "abort"
    return "length" if kind == "length" else "stop"


def aborted_error(metas: Sequence[dict[str, Any]]) -> APIError:
    """The error that ends a response in which these choices were aborted."""
    messages = sorted({(m.get("finish_reason") or {}).get("message") or "aborted" for m in metas})
    ids = ", ".join(str(m.get("id")) for m in metas if m.get("id") is not None)
    which = f" ({ids})" if ids and len(metas) > 1 else ""
    return APIError(400, f"the request was aborted{which}: {'; '.join(messages)}", code="request_aborted")


def matched_stop(meta: dict[str, Any]) -> int | str | None:
    reason = meta.get("finish_reason") or {}
    return reason.get("matched")


def usage(choices: Sequence[Choice], outputs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """OpenAI usage: each prompt counted once, every choice's completion tokens summed."""
    prompt = cached = completion = 0
    counted: set[int] = set()
    for choice in choices:
        meta = outputs[choice.index]["meta_info"] if choice.index in outputs else {}
        completion += meta.get("completion_tokens", 0)
        if choice.prompt_index not in counted:
            counted.add(choice.prompt_index)
            prompt += meta.get("prompt_tokens", len(choice.prompt_ids))
            cached += meta.get("cached_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def run_to_completion(ctx: ServingContext, choices: Sequence[Choice], request: Request) -> list[dict[str, Any]]:
    """Final output of every choice, in order. Aborts them all if the client disconnects."""
    start_requests(ctx, choices, stream=False)
    tasks = [asyncio.ensure_future(_last_output(ctx, c)) for c in choices]
    everything = asyncio.gather(*tasks)
    # A gather left holding a CancelledError logs "exception was never retrieved": retrieve it.
    everything.add_done_callback(lambda f: f.cancelled() or f.exception())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait([everything, watcher], return_when=asyncio.FIRST_COMPLETED)
        if not everything.done():
            # Normal, not an error: the client gave up (a timeout, a closed tab).
            logger.debug("client disconnected; aborting %d choice(s)", len(tasks))
            raise APIError(499, "the client closed the connection", code="client_closed_request")
        try:
            return list(everything.result())
        except EngineDeadError as exc:
            raise engine_dead_error(exc) from None
        except ServerShuttingDownError as exc:
            raise shutting_down_error(exc) from None
    finally:
        # Cancelling a running task closes its manager generator, which aborts the request.
        for task in tasks:
            task.cancel()
        watcher.cancel()
        # Let the cancellations run, so the aborts are sent before the response goes out.
        await asyncio.gather(*tasks, watcher, return_exceptions=True)
        await _close_started(choices)  # a task cancelled before it ran does not close its request


async def _last_output(ctx: ServingContext, choice: Choice) -> dict[str, Any]:
    last: dict[str, Any] = {}
    outputs = _follow(ctx, choice)
    try:
        async for out in outputs:
            last = out  # non-streamed: the one and only output
    finally:
        await outputs.aclose()
    return last


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or never comes).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def start_requests(ctx: ServingContext, choices: Sequence[Choice], stream: bool) -> None:
    """Sends a response's requests to the scheduler now, from its request handler.

    Otherwise they go out when a streamed response's body starts (or a task of
    ``run_to_completion`` runs), and on a burst the event loop first runs the handler of every
    request that has arrived, then the responses: no request of the batch reaches the scheduler
    before all of them are parsed. A failure to send is raised where the outputs are read
    (``stream_outputs`` in-band, ``run_to_completion``), as when sent there; a streamed response
    comes from ``sse_response``, whose ``SSEResponse`` ends streams whose body never ran. A manager
    whose ``sends_on_submit`` is False (one that generates its own way) is sent nothing here: its
    requests go through its ``generate`` when the outputs are first read."""
    manager = ctx.manager
    if not manager.sends_on_submit:
        return
    for i, choice in enumerate(choices):
        choice.request.stream = stream
        try:
            choice.started = manager.submit(choice.request, choice.prepared)
        except Exception as exc:
            for unsent in choices[i:]:  # the rest are not sent: the response fails with this error
                unsent.start_error = exc
            return


def _follow(ctx: ServingContext, choice: Choice) -> Any:
    """The choice's outputs: its started stream, else its request sent now."""
    if choice.start_error is not None:
        raise choice.start_error
    if choice.started is not None:
        return choice.started
    return ctx.manager.generate(choice.request, choice.prepared)


async def _close_started(choices: Sequence[Choice]) -> None:
    for choice in choices:
        if choice.started is not None:
            await choice.started.aclose()  # no-op when it finished or was closed; else the abort


async def stream_outputs(ctx: ServingContext, choices: Sequence[Choice]) -> AsyncIterator[tuple[Choice, dict[str, Any]]]:
    """Every choice's cumulative outputs as they arrive, interleaved.

    Closing this generator (or cancelling its consumer) aborts the choices still running.
    """
    for choice in choices:
        choice.request.stream = True
    failed = next((c.start_error for c in choices if c.start_error is not None), None)
    if failed is not None:
        await _close_started(choices)
        raise failed
    if len(choices) == 1:
        agen = _follow(ctx, choices[0])
        try:
            async for out in agen:
                yield choices[0], out
        finally:
            await agen.aclose()  # no-op when it finished; otherwise sends the abort
        return
    queue: asyncio.Queue[tuple[Choice, dict[str, Any] | None, BaseException | None]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        outputs = _follow(ctx, choice)
        try:
            async for out in outputs:
                queue.put_nowait((choice, out, None))
        except Exception as exc:
            queue.put_nowait((choice, None, exc))
            return
        finally:
            await outputs.aclose()
        queue.put_nowait((choice, None, None))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            choice, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                running -= 1
                continue
            yield choice, out
    finally:
        for task in tasks:
            task.cancel()
        await _close_started(choices)  # a pump cancelled before it ran does not close its stream


def sse(data: dict[str, Any] | list[Any]) -> bytes:
    return f"data: {encode_json(data)}\n\n".encode()


class ChunkSSE:
    """``sse({**head, **tail})`` for the chunks of one stream, ``head`` (id, object, created,
    model) encoded once per stream instead of once per chunk. ``head`` and ``tail`` are not empty."""

    __slots__ = ("_prefix",)

    def __init__(self, head: dict[str, Any]) -> None:
        self._prefix = f"data: {encode_json(head)[:-1]},"

    def __call__(self, tail: dict[str, Any]) -> bytes:
        return f"{self._prefix}{encode_json(tail)[1:]}\n\n".encode()


def log_stream_failure(what: str, exc: BaseException) -> None:
    """Logs a stream that ended in an error; a traceback only for the unexpected (bugs)."""
    if isinstance(exc, APIError):
        return  # the client's problem, reported to the client
    expected = isinstance(exc, (EngineDeadError, RequestError, ServerShuttingDownError))
    logger.warning("%s failed: %s", what, exc, exc_info=None if expected else exc)


def sse_error(exc: BaseException) -> bytes:
    """An in-band error event for a stream whose 200 header is already sent."""
    if isinstance(exc, EngineDeadError):
        exc = engine_dead_error(exc)
    elif isinstance(exc, ServerShuttingDownError):
        exc = shutting_down_error(exc)
    elif isinstance(exc, RequestError):
        exc = from_request_error(exc)
    if not isinstance(exc, APIError):
        exc = APIError(500, f"internal server error: {type(exc).__name__}: {exc}")
    return sse(exc.body())


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that always closes its generator when done.

    Starlette cancels the sending task when the client disconnects; if that
    happens while a chunk is being written, the generator is left suspended and
    would only be closed by the garbage collector. Closing it here makes the
    abort (and the freeing of the request's KV) immediate. ``choices``: those whose
    requests ``start_requests`` sent, ended here too (the body may never have run).
    """

    def __init__(self, content: AsyncIterator[bytes], choices: Sequence[Choice] = ()) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._generator = content
        self._choices = choices

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._generator, "aclose", None)
            if aclose is not None:
                await aclose()
            await _close_started(self._choices)


def sse_response(ctx: ServingContext, choices: Sequence[Choice], content: AsyncIterator[bytes]) -> SSEResponse:
    """A streamed response of ``content``: its choices' requests sent now (``start_requests``) and
    ended with the response, however it ends (the pair every streaming route needs)."""
    start_requests(ctx, choices, stream=True)
    return SSEResponse(content, choices)
