"""OpenAI request fields -> the engine's SamplingParams dict, and the checks both APIs share."""

from __future__ import annotations

from typing import Any

from engine.entrypoints.http.errors import APIError
from engine.entrypoints.http.protocol import SamplingFields

# Engine field names in RequestError messages, as the OpenAI API calls them.
RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}

# OpenAI name -> SamplingParams name, for fields copied when given.
_COPIED = (
    ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
    ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
    ("repetition_penalty", "repetition_penalty"), ("seed", "seed"), ("stop", "stop"),
    ("stop_token_ids", "stop_token_ids"), ("min_tokens", "min_new_tokens"),
)


def check_common(req: SamplingFields) -> None:
    """Rejects what the engine cannot honour, instead of silently ignoring it."""
    if req.logit_bias:
        raise APIError(400, "logit_bias: not supported by this server; omit it or send {}", param="logit_bias")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")


def sampling_params(req: SamplingFields, max_tokens: int) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": max_tokens}
    for api_name, engine_name in _COPIED:
        value = getattr(req, api_name)
        if value is not None:
            params[engine_name] = value
    params.update(ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
                  spaces_between_special_tokens=req.spaces_between_special_tokens,
                  no_stop_trim=req.no_stop_trim)
    return params


def check_max_tokens(max_tokens: int, prompt_len: int, context_len: int, param: str) -> None:
    """A request may not ask for more tokens than its context has room for (vLLM does the same)."""
    room = context_len - prompt_len
    if room > 0 and max_tokens > room:
        raise APIError(400, f"{param}: {max_tokens} is too large: the prompt has {prompt_len} tokens and "
                            f"this model's context length is {context_len}, so at most {room} tokens "
                            "can be generated", param=param)


def stream_usage_wanted(req: SamplingFields) -> bool:
    options = req.stream_options
    return bool(options and (options.include_usage or options.continuous_usage_stats))
