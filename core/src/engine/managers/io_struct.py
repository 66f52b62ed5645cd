"""Messages between the three processes (pickled over ZeroMQ).

tokenizer manager --TokenizedGenerateReqInput/TokenizedEmbeddingReqInput/AbortReq/control--> scheduler
scheduler --BatchTokenIDOut--> detokenizer --BatchStrOut--> tokenizer manager
scheduler --BatchEmbeddingOut--> tokenizer manager (pooled vectors need no detokenizing)
scheduler --control replies--> tokenizer manager
This module is a contract like the hook specs: fields are only ever added.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenizedGenerateReqInput:
    # Unique request id (the tokenizer manager makes one when the client gave none).
    rid: str
    # Prompt token ids.
    input_ids: list[int]
    # SamplingParams fields as a dict (validated by the tokenizer manager).
    sampling_params: dict[str, Any]
    # Whether to return logprobs of output (and prompt) tokens.
    return_logprob: bool = False
    # Prompt logprobs are returned from this position on (-1: none).
    logprob_start_len: int = -1
    # Number of top alternatives per position in the logprob output.
    top_logprobs_num: int = 0
    # Stream tokens as they come (else one message at the end).
    stream: bool = False
    # Higher runs first under the priority policy.
    priority: int = 0
    # Images and video (``engine.multimodal.MultimodalItem``); their placeholder runs in
    # input_ids hold the items' pad ids.
    mm_items: list[Any] = field(default_factory=list)
    # LoRA adapter NAME the request runs with (loaded with --lora-paths or LoadLoraAdapterReqInput);
    # None: the base model.
    lora_name: str | None = None
    # Prefill/decode disaggregation (set by the router): the prefill server's KV transfer address
    # and the room both servers name this request's KV by; None: an ordinary request.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


@dataclass
class TokenizedEmbeddingReqInput:
    """A prefill-only request of a pooling model (--task embed or score): no token is sampled,
    the prompt's token states are pooled into one vector."""

    # Unique request id (the tokenizer manager makes one when the client gave none).
    rid: str
    # Prompt token ids.
    input_ids: list[int]
    # Matryoshka truncation: keep the first this many values (before normalising); None keeps all.
    dimensions: int | None = None
    # Higher runs first under the priority policy.
    priority: int = 0
    # Segment id of each prompt token (a cross-encoder's text pair: 0 for the first text, 1 for
    # the second), as the tokenizer's pair encoding gives them; None: all 0.
    token_type_ids: list[int] | None = None


@dataclass
class BatchEmbeddingOut:
    """Finished pooling requests of one scheduler step (sent straight to the tokenizer manager)."""

    rids: list[str]
    # Per request: the vector (float32 values), or None when the request failed.
    embeddings: list[list[float] | None]
    # Per request: None on success, else {"type": "abort", "message": ...}.
    errors: list[dict[str, Any] | None]
    prompt_tokens: list[int]
    # Prompt tokens served from the radix cache (decoder models with last-token pooling).
    cached_tokens: list[int]


@dataclass
class AbortReq:
    # Request to abort; "" aborts every request.
    rid: str
    # Why (shown to the client in finish_reason.message).
    message: str = "aborted"


@dataclass
class LoadLoraAdapterReqInput:
    """Load a PEFT adapter directory under ``name`` (every TP/PP rank loads it). A ``pinned``
    adapter is never unloaded to make room under --max-loaded-loras."""

    name: str
    path: str
    pinned: bool = False
    # Matches the reply to the request (``LoraAdapterReqOutput.token``).
    token: int = 0
    # Matches the reply (LoraAdapterReqOutput.token) to the request, as ControlReq's does.
    token: int = 0


@dataclass
class UnloadLoraAdapterReqInput:
    """Unload the adapter ``name``: new requests on it are refused at once; it is dropped when
    the requests running on it have finished."""

    name: str
    # Matches the reply to the request (``LoraAdapterReqOutput.token``).
    token: int = 0
    # Matches the reply (LoraAdapterReqOutput.token) to the request.
    token: int = 0


@dataclass
class LoraAdapterReqOutput:
    """The scheduler's answer to a load or unload."""

    success: bool
    # Why it failed (naming the field and value), or what was done.
    message: str
    # Name -> path of every adapter loaded after the call.
    loaded: dict[str, str] = field(default_factory=dict)
    # The request's token.
    token: int = 0
    # The request's token (the scheduler copies it from the load or unload request).
    token: int = 0


@dataclass
class ControlReq:
    # "flush_cache" | "server_info" | "health" | "shutdown".
    kind: str
    # Matches the reply to the request.
    token: int = 0


@dataclass
class ControlReply:
    kind: str
    token: int
    ok: bool = True
    # Reply payload (server info, flush outcome...).
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class BatchTokenIDOut:
    """New output tokens of several requests after one scheduler step."""

    rids: list[str]
    # Per request: ids generated since the previous message for it.
    new_token_ids: list[list[int]]
    # Per request: None while running, else {"type": "stop"|"length"|"abort", ...}.
    finished_reasons: list[dict[str, Any] | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    # Detokenization options and stop strings of each request.
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    stop_strings: list[list[str]]
    no_stop_trim: list[bool]
    # Per request, for the new tokens: [(logprob, token_id)] and [[(logprob, token_id)] * k].
    output_token_logprobs: list[list[tuple[float, int]]] | None = None
    output_top_logprobs: list[list[list[tuple[float, int]]]] | None = None
    # Per request: prompt logprobs [(logprob or None, token_id)], sent once with the first tokens.
    input_token_logprobs: list[list[tuple[float | None, int]] | None] | None = None
    input_top_logprobs: list[list[list[tuple[float, int]]] | None] | None = None
    # Per request: the prompt's last tokens with the request's first message (decoding
    # context for the first output tokens), else None.
    prompt_tail_ids: list[list[int] | None] | None = None
    # Speculative decoding (None when off): per request, verify forwards it took part in and
    # draft tokens the target kept in them (totals so far).
    spec_verify_ct: list[int] | None = None
    spec_accepted_tokens: list[int] | None = None
    # Per request: its stage times (managers/timeline.py) once it finished, else None.
    stages: list[list[tuple[str, float, int]] | None] | None = None


@dataclass
class BatchStrOut:
    """Detokenized increments, one entry per request."""

    rids: list[str]
    # Per request: text finalised since the previous message.
    new_texts: list[str]
    new_token_ids: list[list[int]]
    finished_reasons: list[dict[str, Any] | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs: list[list[tuple[float, int]]] | None = None
    output_top_logprobs: list[list[list[tuple[float, int]]]] | None = None
    input_token_logprobs: list[list[tuple[float | None, int]] | None] | None = None
    input_top_logprobs: list[list[list[tuple[float, int]]] | None] | None = None
    # Speculative decoding, as in BatchTokenIDOut (None when off).
    spec_verify_ct: list[int] | None = None
    spec_accepted_tokens: list[int] | None = None
    # As in BatchTokenIDOut.
    stages: list[list[tuple[str, float, int]] | None] | None = None


@dataclass
class SchedulerReady:
    """First message of the scheduler process to its parent: what it loaded."""

    max_total_num_tokens: int
    max_running_requests: int
    context_len: int
    vocab_size: int
    device: str
    attention_backend: str
    platform: str
    dtype: str
    eos_token_ids: list[int]
    plugins: list[dict[str, Any]]
    # "generate" | "embed" | "score" (``engine.pooling.resolve_task``).
    task: str = "generate"
    # Pooling models: the length of the vectors returned (hidden size, or labels for score).
    embedding_size: int = 0
    # Pooling models: ``PoolingConfig.to_dict()`` plus "matryoshka" (bool) and
    # "matryoshka_dimensions" (accepted sizes, None: any up to embedding_size).
    pooling: dict[str, Any] = field(default_factory=dict)
    # The model takes images (and video): it implements ``engine.multimodal.MultimodalModel``.
    multimodal: bool = False
