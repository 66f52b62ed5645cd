"""Request models of the HTTP API (pydantic, validated from the raw JSON body).

Models are strict (``"10"`` is not an integer) and forbid unknown fields, so a
typo such as ``temprature`` is a 400 naming the field instead of being silently
ignored. Every field of OpenAI's published chat and completions request schemas is
declared: those that apply act, the others (``IGNORED_FIELDS``: bookkeeping, hosted
features) are accepted and ignored with one debug log per request. Null means the default
wherever OpenAI's schema allows null. Responses are plain dicts built by the serving modules;
the tests check them against the ``openai`` package's types.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

# Context-free limits OpenAI documents; the context length is checked per request.
MAX_N = 128
MAX_TOP_LOGPROBS = 20

#: Request fields accepted and ignored: they change nothing in the output of a self-hosted
#: model (OpenAI's bookkeeping, caching hints, hosted tools, vLLM's grammar-backend choice).
IGNORED_FIELDS = ("store", "metadata", "service_tier", "user", "prompt_cache_key", "prompt_cache_options",
                  "prompt_cache_retention", "safety_identifier", "verbosity", "prediction", "web_search_options",
                  "moderation", "guided_decoding_backend", "guided_whitespace_pattern")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    # Send a last chunk with ``usage`` (and ``"usage": null`` on every other chunk).
    include_usage: bool = False
    # vLLM/SGLang extension: usage on every chunk. Accepted, treated as include_usage.
    continuous_usage_stats: bool = False
    # OpenAI pads chunks against side channels on its network; nothing to pad here.
    include_obfuscation: bool = True


def _null_means_default(model: type[BaseModel], data: Any) -> Any:
    """Drops explicit nulls of fields whose default is not null (OpenAI: null is the default)."""
    if not isinstance(data, dict):
        return data
    fields = model.model_fields
    return {k: v for k, v in data.items()
            if not (v is None and k in fields and fields[k].default is not None and not fields[k].is_required())}


class SamplingFields(_Body):
    """Sampling fields shared by chat and text completions (OpenAI names + SGLang extras)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # -- SGLang extensions, passed to the sampler as they are ---------------------
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_token_ids: list[int] | None = None
    # Structured output beyond response_format (SGLang): the output matches a regex / an EBNF grammar.
    regex: str | None = None
    ebnf: str | None = None
    # Higher runs first under ``--schedule-policy priority``.
    priority: int | None = None
    # Request id for /abort_request (``-i`` is appended per choice when n > 1).
    rid: str | None = None
    # Prefill/decode disaggregation (set by ``engine router``; docs/disaggregation.md): the prefill
    # server's KV transfer address and the room naming this request's KV. Checked by
    # entrypoints.http.disaggregation.
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    # -- vLLM's structured-output fields, onto the grammar parameters above --
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # -- accepted and ignored (OpenAI bookkeeping that does not change the output) --
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return _null_means_default(cls, data)

    def ignored_fields(self) -> list[str]:
        """The fields of this request that were accepted and have no effect here."""
        return [name for name in IGNORED_FIELDS if getattr(self, name, None) is not None]


class ContentPart(BaseModel):
    """One part of a multi-part message: ``text``, or on the chat route ``image_url`` / ``video_url``
    (their payload stays in the extra fields; ``entrypoints.http.media_parts`` reads it)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra keys (``tool_call_id``, ``refusal``...) are tolerated: clients echo
    # back assistant messages they received, with whatever fields those had.
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Validated even when absent: only an assistant message may leave it out (OpenAI's rule:
    # its reply may be tool calls alone).
    content: str | list[ContentPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _content_required(cls, content: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if content is None and role is not None and role != "assistant":
            raise PydanticCustomError("missing_content", "a {role} message needs content: a string or a list of "
                                      "text parts", {"role": role})
        return content


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Function tools, checked by tool_calling.plan_tools (a 400 naming tools[i].function.name etc.).
    tools: list[dict[str, Any]] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}.
    tool_choice: str | dict[str, Any] | None = None
    # False: at most one call.
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # Extra variables for the tokenizer's chat template (e.g. enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # "none" turns thinking off (enable_thinking=false) on a server with --reasoning-parser;
    # the other levels are the model's own (accepted, ignored).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # Only text is generated: ["text"] is accepted, audio is a 400.
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    # The deprecated functions API, served as tools (the answer carries tool_calls).
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # -- accepted and ignored (IGNORED_FIELDS) --
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    # Legacy: the number of most likely tokens to report per position (0..20).
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    # Not supported (insertion needs a fill-in-the-middle model); rejected clearly.
    suffix: str | None = None
    # Structured output, as in chat: text, json_object, json_schema (vLLM and SGLang accept it here too).
    response_format: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class GenerateReqInput(_Body):
    """SGLang's native ``/generate`` body: one prompt or a batch.

    Every field of SGLang's ``GenerateReqInput`` is declared, so its clients' bodies pass;
    ``native_request`` says what each does (acts, ignored, or a 400 unless "off"). Null is
    accepted wherever SGLang's clients send it and means the default.
    """

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    # SamplingParams fields (checked by native_request, then SamplingParams, with their own messages).
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool | None = False
    # The logprob fields take one value for every prompt or a list with one per prompt.
    return_logprob: bool | list[bool] | None = None
    # First prompt position to score (-1: output tokens only).
    logprob_start_len: int | list[int] | None = None
    # 0..20, checked per prompt by the tokenizer manager.
    top_logprobs_num: int | list[int] | None = None
    # Add each token's text as the third element of every logprob entry.
    return_text_in_logprobs: bool | None = False
    rid: str | list[str] | None = None
    priority: int | None = None
    no_logs: bool | None = False
    # A loaded LoRA adapter's name (or its path): one for every prompt, or one (or null) per prompt.
    lora_path: str | list[str | None] | None = None
    # SGLang's internal adapter id (its tokenizer manager sets it from lora_path); ignored.
    lora_id: Any = None
    # -- SGLang features this server lacks: any type here, native_request accepts only "off" --
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    modalities: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: Any = False
    session_params: Any = None
    custom_logit_processor: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    data_parallel_rank: Any = None
    background: Any = False
    extra_key: Any = None
    custom_labels: Any = None
    return_bytes: Any = False
    return_entropy: Any = False
    log_metrics: Any = True
    # -- bookkeeping of SGLang's own server and logs; ignored --
    validation_time: float | int | None = None
    conversation_id: str | None = None


class AbortRequest(_Body):
    rid: str = ""
    # Abort every request in flight (SGLang's abort_all).
    abort_all: bool = False


class LoadLoraAdapterRequest(_Body):
    """``POST /load_lora_adapter`` (SGLang's body; vLLM's ``/v1/load_lora_adapter`` takes the same)."""

    # The name requests select it by (``lora_path`` of /generate, ``model`` of the OpenAI routes).
    lora_name: str
    # A PEFT adapter directory (adapter_config.json and adapter_model.safetensors) on the server.
    lora_path: str
    # Never unloaded to make room under --max-loaded-loras.
    pinned: bool = False
    # SGLang's internal adapter id; ignored.
    lora_id: Any = None
    # vLLM's: replace the weights of an adapter loaded under this name (only false here).
    load_inplace: bool = False


class UnloadLoraAdapterRequest(_Body):
    """``POST /unload_lora_adapter``: requests running on the adapter finish with it."""

    lora_name: str
    # SGLang's internal adapter id (vLLM's lora_int_id); ignored.
    lora_id: Any = None
    lora_int_id: Any = None
