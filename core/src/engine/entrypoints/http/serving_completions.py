"""``POST /v1/completions``: text or token-id prompts (single or batch), echo, legacy logprobs."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse, Response

from engine.entrypoints.http.disaggregation import bootstrap_fields
from engine.entrypoints.http.errors import APIError, parse_body
from engine.entrypoints.http.generation import (
    SSE_DONE,
    Choice,
    ChunkSSE,
    aborted_error,
    finish_reason,
    log_stream_failure,
    make_choices,
    matched_stop,
    response_model,
    run_to_completion,
    sse_error,
    sse_response,
    stream_finish_reason,
    stream_outputs,
    usage,
)
from engine.entrypoints.http.logprobs import completion_logprobs, merge_completion_logprobs
from engine.entrypoints.http.protocol import CompletionRequest
from engine.entrypoints.http.sampling import (
    RENAMES,
    check_common,
    check_max_tokens,
    grammar_renames,
    guided_renames,
    sampling_params,
    stream_usage_wanted,
)
from engine.managers.tokenizer_manager import GenerateRequest

if TYPE_CHECKING:
    from starlette.requests import Request

    from engine.entrypoints.http.context import ServingContext

logger = logging.getLogger(__name__)

_RENAMES = {**RENAMES, "input_ids": "prompt", "text": "prompt"}
# OpenAI's default for the legacy completions API.
_DEFAULT_MAX_TOKENS = 16


async def create_completion(ctx: ServingContext, request: Request) -> Response:
    req = parse_body(await request.body(), CompletionRequest)
    lora = ctx.resolve_model(req.model)
    _check_supported(req)
    ctx.check_accepting()
    prompts = await _prompt_ids(ctx, req)
    max_tokens = _DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    if max_tokens < 1:
        raise APIError(400, "max_tokens: must be at least 1 (prompt scoring with max_tokens 0 is not "
                            "supported; use /generate with return_logprob and logprob_start_len 0)",
                       param="max_tokens")
    response_id = f"cmpl-{uuid.uuid4().hex}"
    rid = req.rid or response_id
    bootstrap = bootstrap_fields(ctx, req, len(prompts))
    bases = [GenerateRequest(
        input_ids=ids, sampling_params=sampling_params(req, max_tokens),
        rid=rid if len(prompts) == 1 else f"{rid}-{p}",
        return_logprob=req.logprobs is not None,
        # With echo the prompt's logprobs are wanted too, from its first token.
        logprob_start_len=0 if req.echo and req.logprobs is not None else -1,
        top_logprobs_num=req.logprobs or 0, priority=req.priority or 0, lora_path=lora,
        **bootstrap[p],
    ) for p, ids in enumerate(prompts)]
    choices = await make_choices(ctx, bases, req.n, renames={**_RENAMES, **grammar_renames(req.response_format),
                                                             **guided_renames(req)},
                                 group_rid=rid)
    for choice in choices:
        check_max_tokens(max_tokens, len(choice.prompt_ids), ctx.context_len, "max_tokens")
    created = int(time.time())
    echoes = [_echo_text(ctx, req, prompts, c) for c in choices]
    if req.stream:
        return sse_response(ctx, choices, _stream(ctx, req, choices, echoes, response_id, created))
    outputs = await run_to_completion(ctx, choices, request)
    body_choices = []
    for choice, out, echo in zip(choices, outputs, echoes, strict=True):
        meta = out["meta_info"]
        reason = finish_reason(meta)
        body_choices.append({
            "index": choice.index, "text": echo + out["text"],
            "logprobs": _logprobs(ctx, req, meta, 0, echo, first=True),
            "finish_reason": reason, "matched_stop": matched_stop(meta),
        })
    by_index = {c.index: out for c, out in zip(choices, outputs, strict=True)}
    return JSONResponse({
        "id": response_id, "object": "text_completion", "created": created,
        "model": response_model(ctx, req.model, lora),
        "choices": body_choices, "usage": usage(choices, by_index), "system_fingerprint": None,
    })


def _check_supported(req: CompletionRequest) -> None:
    check_common(req)
    if req.suffix is not None:
        raise APIError(400, "suffix: not supported (insertion needs a fill-in-the-middle model); omit it",
                       param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, f"best_of: only best_of == n is supported (got best_of {req.best_of}, n {req.n})",
                       param="best_of")


async def _prompt_ids(ctx: ServingContext, req: CompletionRequest) -> list[list[int]]:
    """The request's prompts as token-id lists (text is tokenized as /generate would, off the loop)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        texts: list[Any] = [prompt]
    elif not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    elif isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    else:
        texts = list(prompt)
    out: list[list[int]] = []
    for item in texts:
        if isinstance(item, str):
            param = "prompt" if isinstance(prompt, str) else f"prompt[{len(out)}]"
            out.append(await ctx.encode(item, param))
        else:
            out.append(list(item))
    return out


def _echo_text(ctx: ServingContext, req: CompletionRequest, prompts: list[list[int]], choice: Choice) -> str:
    if not req.echo:
        return ""
    prompt = req.prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return str(prompt[choice.prompt_index])
    return ctx.tokenizer.decode(prompts[choice.prompt_index]) if ctx.tokenizer is not None else ""


def _logprobs(ctx: ServingContext, req: CompletionRequest, meta: dict[str, Any], start: int, echo: str,
              first: bool) -> dict[str, Any] | None:
    """Legacy logprobs of output tokens from ``start`` (plus the echoed prompt's on the first block)."""
    if req.logprobs is None:
        return None
    top_n = req.logprobs
    parts = []
    offset = len(echo) if first else 0
    if first and req.echo and meta.get("input_token_logprobs") is not None:
        parts.append(completion_logprobs(meta["input_token_logprobs"], meta.get("input_top_logprobs"),
                                         ctx.token_text, top_n, 0))
    entries = (meta.get("output_token_logprobs") or [])[start:]
    tops = (meta.get("output_top_logprobs") or [])[start:]
    parts.append(completion_logprobs(entries, tops, ctx.token_text, top_n, offset))
    return merge_completion_logprobs(parts)


async def _stream(ctx: ServingContext, req: CompletionRequest, choices: list[Choice], echoes: list[str],
                  response_id: str, created: int) -> AsyncIterator[bytes]:
    with_usage = stream_usage_wanted(req)
    model = response_model(ctx, req.model, choices[0].request.lora_path)

    encode_chunk = ChunkSSE({"id": response_id, "object": "text_completion", "created": created, "model": model})

    def chunk(parts: list[dict[str, Any]], usage_block: dict[str, Any] | None = None) -> bytes:
        data: dict[str, Any] = {"choices": parts}
        if with_usage:
            data["usage"] = usage_block
        return encode_chunk(data)

    sent_chars = {c.index: 0 for c in choices}
    sent_logprobs = {c.index: 0 for c in choices}
    # Characters of the choice's text before this chunk (text_offset of streamed logprobs).
    text_so_far = {c.index: len(echoes[c.index]) for c in choices}
    started: set[int] = set()
    finals: dict[int, dict[str, Any]] = {}
    aborted: list[dict[str, Any]] = []
    try:
        async for choice, out in stream_outputs(ctx, choices):
            i = choice.index
            meta = out["meta_info"]
            reason = stream_finish_reason(meta)  # "abort" ends this choice; the others run on
            if reason == "abort":
                aborted.append(meta)
            first = i not in started
            started.add(i)
            delta = out["text"][sent_chars[i]:]
            sent_chars[i] = len(out["text"])
            logprobs = None
            if req.logprobs is not None:
                logprobs = _logprobs(ctx, req, meta, sent_logprobs[i], echoes[i], first)
                if not first:
                    logprobs["text_offset"] = [o + text_so_far[i] for o in logprobs["text_offset"]]
                sent_logprobs[i] = len(meta.get("output_token_logprobs") or [])
                if not logprobs["tokens"]:
                    logprobs = None
            text = (echoes[i] if first else "") + delta
            if not first:
                text_so_far[i] += len(delta)
            else:
                text_so_far[i] = len(text)
            if not text and logprobs is None and reason is None:
                continue
            part: dict[str, Any] = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
            if reason is not None:
                part["matched_stop"] = matched_stop(meta)
                finals[i] = out
            yield chunk([part])
        if with_usage:
            yield chunk([], usage(choices, finals))
        if aborted:
            yield sse_error(aborted_error(aborted))
    except Exception as exc:
        log_stream_failure(f"completion stream {response_id}", exc)
        yield sse_error(exc)
    yield SSE_DONE
