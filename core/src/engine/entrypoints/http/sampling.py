"""OpenAI request fields -> the engine's SamplingParams dict, and the checks both APIs share."""

from __future__ import annotations

import json
import logging
from typing import Any

from engine.entrypoints.http.errors import APIError
from engine.entrypoints.http.protocol import SamplingFields

logger = logging.getLogger(__name__)

# Engine field names in RequestError messages, as the OpenAI API calls them.
# The OpenAI routes select a LoRA adapter by ``model``: an adapter unloaded after the route read
# ``model`` is refused by the tokenizer manager under the engine's name, ``lora_path``.
RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "lora_path": "model"}

# OpenAI name -> SamplingParams name, for fields copied when given.
_COPIED = (
    ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
    ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
    ("repetition_penalty", "repetition_penalty"), ("seed", "seed"), ("stop", "stop"),
    ("stop_token_ids", "stop_token_ids"), ("min_tokens", "min_new_tokens"),
)


def check_common(req: SamplingFields) -> None:
    """Rejects what the engine cannot honour, instead of silently ignoring it; logs (debug) the
    accepted fields that have no effect here."""
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")
    ignored = req.ignored_fields()
    if ignored:
        logger.debug("request fields accepted and ignored: %s", ", ".join(ignored))


def sampling_params(req: SamplingFields, max_tokens: int) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": max_tokens}
    for api_name, engine_name in _COPIED:
        value = getattr(req, api_name)
        if value is not None:
            params[engine_name] = value
    params.update(ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
                  spaces_between_special_tokens=req.spaces_between_special_tokens,
                  no_stop_trim=req.no_stop_trim)
    if req.logit_bias:
        params["logit_bias"] = _logit_bias(req.logit_bias)
    # SGLang's extensions of the OpenAI API: a regex or EBNF grammar on the output.
    for name in ("regex", "ebnf"):
        if getattr(req, name) is not None:
            params[name] = getattr(req, name)
    grammar = response_format_params(getattr(req, "response_format", None))
    given = [name for name in ("regex", "ebnf") if name in params]
    if grammar and given:
        raise APIError(400, f"response_format: cannot be combined with {given[0]}; send one of them",
                       param="response_format")
    params.update(grammar)
    guided = guided_params(req)
    if guided:
        taken = [k for k in ("json_schema", "regex", "ebnf", "structural_tag") if k in params]
        if taken:
            clash = "response_format" if taken[0] in ("json_schema", "structural_tag") else taken[0]
            raise APIError(400, f"{next(iter(guided.values()))[1]}: cannot be combined with {clash}; send one of them",
                           param=next(iter(guided.values()))[1])
        params.update({k: v for k, (v, _) in guided.items()})
    return params


# vLLM's structured-output fields: (field, the engine's grammar parameter).
GUIDED_FIELDS = (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "ebnf"),
                 ("guided_grammar", "ebnf"))


def guided_params(req: SamplingFields) -> dict[str, tuple[str, str]]:
    """vLLM's ``guided_*`` fields as {engine grammar parameter: (value, field)}; one at most."""
    given = [(name, engine) for name, engine in GUIDED_FIELDS if getattr(req, name, None) is not None]
    if not given:
        return {}
    if len(given) > 1:
        raise APIError(400, f"{given[1][0]}: cannot be combined with {given[0][0]}; send one guided_* field",
                       param=given[1][0])
    name, engine = given[0]
    value = getattr(req, name)
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise APIError(400, "guided_json: not valid JSON; expected a JSON Schema (an object or its JSON "
                                    "text)", param="guided_json") from None
        if not isinstance(value, dict):
            raise APIError(400, "guided_json: expected a JSON Schema object", param="guided_json")
        return {engine: (json.dumps(value), name)}
    if name == "guided_choice":
        if not value:
            raise APIError(400, "guided_choice: expected at least one choice", param="guided_choice")
        # An EBNF alternation of string literals (JSON escapes are the grammar's escapes).
        return {engine: ("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value), name)}
    return {engine: (value, name)}


def guided_renames(req: SamplingFields) -> dict[str, str]:
    """Engine grammar parameter -> the guided_* field, for grammar errors."""
    return {engine: field for engine, (_, field) in guided_params(req).items()}


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not key.strip().isdigit():
            raise APIError(400, f"logit_bias: key {key!r} is not a token id; accepted: token ids as strings, "
                                'e.g. {"50256": -100}', param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise APIError(400, f"logit_bias: the bias of token {key} is {value}; accepted: -100 to 100",
                           param="logit_bias")
        out[int(key)] = value
    return out


#: The schema OpenAI's ``json_object`` stands for: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def response_format_params(response_format: dict[str, Any] | None) -> dict[str, str]:
    """OpenAI's ``response_format`` as the engine's grammar parameter ({} for text or none).

    ``json_object`` is any JSON object; ``json_schema`` takes ``json_schema.schema`` (``strict``
    is accepted either way: the output always follows the schema); ``structural_tag`` (SGLang)
    is passed to the grammar backend as it is.
    """
    if response_format is None:
        return {}
    if not isinstance(response_format, dict):
        raise APIError(400, "response_format: expected an object with a 'type'", param="response_format")
    kind = response_format.get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError(400, "response_format.json_schema: required with type 'json_schema': an object with "
                                "'name' and 'schema'", param="response_format.json_schema")
        schema = spec.get("schema", spec.get("schema_"))
        if schema is None:
            # OpenAI allows leaving the schema out: then any JSON object.
            return {"json_schema": JSON_OBJECT_SCHEMA}
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema: expected a JSON Schema object, got "
                                f"{type(schema).__name__}", param="response_format.json_schema.schema")
        if not isinstance(spec.get("strict", False), (bool, type(None))):
            raise APIError(400, "response_format.json_schema.strict: expected true or false",
                           param="response_format.json_schema.strict")
        return {"json_schema": json.dumps(schema)}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(response_format)}
    raise APIError(400, f"response_format.type: invalid value {kind!r}; accepted: text, json_object, "
                        "json_schema, structural_tag", param="response_format.type")


def grammar_renames(response_format: dict[str, Any] | None) -> dict[str, str]:
    """Engine field -> API field for grammar errors: a bad schema from ``response_format`` is a
    400 naming ``response_format.json_schema.schema``, not the engine's ``json_schema``."""
    if not isinstance(response_format, dict):
        return {}
    kind = response_format.get("type")
    if kind == "json_schema":
        return {"json_schema": "response_format.json_schema.schema"}
    if kind == "json_object":
        return {"json_schema": "response_format"}
    if kind == "structural_tag":
        return {"structural_tag": "response_format"}
    return {}


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
