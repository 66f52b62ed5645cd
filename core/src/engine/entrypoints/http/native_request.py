"""What ``/generate`` does with each field of SGLang's native request, and the body -> requests step.

SGLang clients (its ``bench_serving``, its ``RuntimeEndpoint``, router sidecars) send
the whole of SGLang's ``GenerateReqInput`` and ``SamplingParams``, with nulls and
defaults for what they do not use (``"lora_path": null`` on every request). Every such
field therefore has one of three fates here, listed in docs/native-api.md:

- it acts (``ACTING_FIELDS``, and the sampling parameters ``SamplingParams`` knows);
- it is bookkeeping that changes no output and is ignored (``IGNORED_FIELDS``);
- it asks for a feature this server lacks (``UNSUPPORTED_FIELDS``,
  ``UNSUPPORTED_SAMPLING``): accepted at its "off" value, a 400 naming the feature otherwise,
  never silently dropped.

The field list is SGLang 0.5.5's (``io_struct.GenerateReqInput``, ``sampling_params.SamplingParams``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.entrypoints.http.disaggregation import bootstrap_fields
from engine.entrypoints.http.errors import APIError, from_request_error
from engine.managers.tokenizer_manager import GenerateRequest, RequestError

if TYPE_CHECKING:
    from engine.entrypoints.http.context import ServingContext
    from engine.entrypoints.http.protocol import GenerateReqInput


@dataclass(frozen=True)
class Unsupported:
    """A field that asks for a feature this server does not have."""

    # Field name, as SGLang spells it.
    name: str
    # The feature, as the 400 names it.
    feature: str
    # Values that leave the feature off (a list of them, one per prompt, is off too).
    off: tuple[Any, ...] = (None,)


# Request fields that act here (see GenerateReqInput in protocol.py for their types).
ACTING_FIELDS = (
    "text", "input_ids", "sampling_params", "stream", "rid", "priority", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
    # This server never logs prompts or outputs, so a request that forbids it is honoured as is.
    "no_logs",
    # A loaded LoRA adapter's name (or the path it was loaded from), one for all prompts or one per prompt.
    "lora_path",
    # Images and video of vision-language models (docs/multimodal.md); one entry per prompt in a batch.
    "image_data", "video_data",
    # Prefill/decode disaggregation (docs/disaggregation.md): set by `engine router`.
    "bootstrap_host", "bootstrap_port", "bootstrap_room",
)

# Set by SGLang's own HTTP layer or used only to label its logs: nothing here to change.
# ``lora_id`` is the id SGLang's tokenizer manager fills in from ``lora_path``; here the adapter
# name travels on its own.
# ``modalities`` is SGLang's hint of the media kinds of a request ("image", "multi-images", "video"):
# here each item's own field (image_data, video_data) says what it is.
IGNORED_FIELDS = ("validation_time", "conversation_id", "lora_id", "modalities")

_MULTIMODAL_OFF = (None, [])
UNSUPPORTED_FIELDS = (
    Unsupported("input_embeds", "input embeddings (send text or input_ids)"),
    Unsupported("audio_data", "audio inputs", _MULTIMODAL_OFF),
    Unsupported("token_ids_logprob", "logprobs of chosen token ids", (None, [])),
    Unsupported("return_hidden_states", "returning hidden states", (None, False)),
    Unsupported("session_params", "sessions (continuing a cached prompt)", (None, {})),
    Unsupported("custom_logit_processor", "custom logit processors"),
    Unsupported("bootstrap_pair_key", "pairing keys of prefill/decode disaggregation (the room and the request id pair them)"),
    Unsupported("data_parallel_rank", "data-parallel routing (this server has one rank, 0)", (None, 0)),
    Unsupported("background", "background requests", (None, False)),
    Unsupported("extra_key", "prefix-cache namespaces (extra_key)"),
    Unsupported("custom_labels", "custom metric labels", (None, {})),
    Unsupported("return_bytes", "byte outputs", (None, False)),
    Unsupported("return_entropy", "returning entropy", (None, False)),
    Unsupported("log_metrics", "leaving a request out of /metrics", (None, True)),
)

# SamplingParams fields of SGLang's that this server's sampler lacks. (json_schema, regex, ebnf,
# structural_tag and logit_bias go to the engine's SamplingParams, which checks them.)
UNSUPPORTED_SAMPLING = (
    Unsupported("stop_regex", "regular-expression stop conditions", (None, [], "")),
    Unsupported("custom_params", "custom logit processors", (None, {})),
    # This server streams every token, which is SGLang's interval 1.
    Unsupported("stream_interval", "per-request stream intervals (every token is streamed)", (None, 1)),
)


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    if isinstance(value, list) and value and value not in off:
        return all(_is_off(v, off) for v in value)  # one "off" value per prompt of a batch
    # Compare types too: 0 == False in Python, but data_parallel_rank false is not rank 0.
    return any(type(value) is type(o) and value == o for o in off)


def _reject_unsupported(values: dict[str, Any], table: tuple[Unsupported, ...], prefix: str) -> None:
    for spec in table:
        value = values.get(spec.name)
        if not _is_off(value, spec.off):
            accepted = " or ".join(json.dumps(o) for o in spec.off)
            shown = json.dumps(value, default=str)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise APIError(400, f"{prefix}{spec.name}: {shown} asks for {spec.feature}, which this server does "
                                f"not support; accepted: {accepted} (or omit the field)",
                           param=prefix + spec.name, code="unsupported_feature")


def check_request_fields(req: GenerateReqInput) -> None:
    """A 400 naming the feature for any SGLang field set to something this server cannot do."""
    _reject_unsupported({spec.name: getattr(req, spec.name) for spec in UNSUPPORTED_FIELDS}, UNSUPPORTED_FIELDS, "")


def engine_sampling_params(params: dict[str, Any], context_len: int, where: str) -> dict[str, Any]:
    """SGLang's sampling params as the engine's: nulls are defaults, SGLang-only names mapped.

    Args:
        params: one prompt's ``sampling_params`` as sent.
        context_len: the model's context; ``max_new_tokens: null`` means "until it is full",
            as in SGLang (the scheduler caps it per prompt).
        where: the field path for error messages (``sampling_params`` or ``sampling_params[i]``).
    """
    _reject_unsupported(params, UNSUPPORTED_SAMPLING, f"{where}.")
    unsupported = {spec.name for spec in UNSUPPORTED_SAMPLING}
    out = {k: v for k, v in params.items() if v is not None and k not in unsupported}
    if "max_new_tokens" in params and params["max_new_tokens"] is None:
        out["max_new_tokens"] = context_len
    seed = params.get("sampling_seed")
    out.pop("sampling_seed", None)
    if seed is not None:
        # SGLang's name for the sampler's seed; ours (and the OpenAI API's) is ``seed``.
        if out.get("seed", seed) != seed:
            raise APIError(400, f"{where}.sampling_seed: {seed!r} contradicts seed {out['seed']!r}; send one of them",
                           param=f"{where}.sampling_seed")
        out["seed"] = seed
    return out


def _per_prompt(value: Any, count: int, name: str, default: Any) -> list[Any]:
    """A scalar for every prompt, or a list with one entry per prompt (SGLang allows both)."""
    if isinstance(value, list):
        if len(value) != count:
            raise APIError(400, f"{name}: {len(value)} entries for {count} prompts", param=name)
        return [default if v is None else v for v in value]
    return [default if value is None else value] * count


def _media_per_prompt(value: Any, count: int, batch: bool, name: str) -> list[Any]:
    """``image_data``/``video_data`` per prompt: as given for one prompt; for a batch, a list with
    one entry (or null) per prompt."""
    if value is None or value == []:
        return [None] * count
    if not batch:
        return [value]
    if not isinstance(value, list) or len(value) != count:
        raise APIError(400, f"{name}: a batch of {count} prompts needs a list of {count} entries (null for none)",
                       param=name)
    return list(value)


def build_requests(ctx: ServingContext, req: GenerateReqInput) -> tuple[list[GenerateRequest], list[int], bool]:
    """The body's prompts as GenerateRequests, with each one's ``n``; and whether it is a batch."""
    check_request_fields(req)
    if (req.text is None) == (req.input_ids is None):
        raise APIError(400, "give exactly one of text and input_ids", param="text")
    if req.text is not None:
        batch = isinstance(req.text, list)
        texts: list[Any] = list(req.text) if batch else [req.text]
        ids: list[Any] = [None] * len(texts)
    else:
        assert req.input_ids is not None
        batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        ids = list(req.input_ids) if batch else [req.input_ids]
        texts = [None] * len(ids)
    count = len(texts)
    if count == 0:
        raise APIError(400, "the batch is empty", param="text" if req.text is not None else "input_ids")
    params = req.sampling_params
    if isinstance(params, list):
        if len(params) != count:
            raise APIError(400, f"sampling_params: {len(params)} entries for {count} prompts", param="sampling_params")
        per_prompt = [engine_sampling_params(p, ctx.context_len, f"sampling_params[{i}]") for i, p in enumerate(params)]
    else:
        per_prompt = [engine_sampling_params(params or {}, ctx.context_len, "sampling_params") for _ in range(count)]
    if isinstance(req.rid, list) and len(req.rid) != count:
        raise APIError(400, f"rid: {len(req.rid)} ids for {count} prompts", param="rid")
    if req.rid is not None and not isinstance(req.rid, list) and count > 1:
        raise APIError(400, "rid: a batch needs a list of ids, one per prompt", param="rid")
    rids = req.rid if isinstance(req.rid, list) else [req.rid] * count
    want_logprob = _per_prompt(req.return_logprob, count, "return_logprob", False)
    start_len = _per_prompt(req.logprob_start_len, count, "logprob_start_len", -1)
    top_num = _per_prompt(req.top_logprobs_num, count, "top_logprobs_num", 0)
    images = _media_per_prompt(req.image_data, count, batch, "image_data")
    videos = _media_per_prompt(req.video_data, count, batch, "video_data")
    loras = _lora_names(ctx, req.lora_path, count)
    bootstrap = bootstrap_fields(ctx, req, count)
    prompts, copies = [], []
    for i in range(count):
        n = per_prompt[i].pop("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise APIError(400, f"sampling_params.n: invalid value {n!r}; accepted: an integer >= 1",
                           param="sampling_params.n")
        copies.append(n)
        prompts.append(GenerateRequest(
            text=texts[i], input_ids=ids[i], sampling_params=per_prompt[i], rid=rids[i],
            return_logprob=want_logprob[i], logprob_start_len=start_len[i], top_logprobs_num=top_num[i],
            stream=bool(req.stream), priority=req.priority or 0,
            image_data=images[i], video_data=videos[i], lora_path=loras[i], **bootstrap[i]))
    return prompts, copies, batch


def _lora_names(ctx: ServingContext, value: Any, count: int) -> list[str | None]:
    """Each prompt's adapter name: one ``lora_path`` for all, or one per prompt (null: the base
    model); a name no adapter is loaded under is a 400 naming it, before anything runs."""
    if isinstance(value, list) and len(value) != count:
        raise APIError(400, f"lora_path: {len(value)} entries for {count} prompts", param="lora_path")
    values = value if isinstance(value, list) else [value] * count
    if all(v is None for v in values):
        return [None] * count  # the base model (also on a server without LoRA)
    try:
        return [ctx.manager.lora.resolve(v, f"lora_path[{i}]" if isinstance(value, list) else "lora_path")
                for i, v in enumerate(values)]
    except RequestError as exc:
        raise from_request_error(exc) from None
