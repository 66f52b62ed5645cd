"""The native /generate field table: every SGLang field acts, is ignored, or is a 400 unless "off"."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine.entrypoints.http.errors import APIError, parse_body
from engine.entrypoints.http.native_request import (
    ACTING_FIELDS,
    IGNORED_FIELDS,
    UNSUPPORTED_FIELDS,
    UNSUPPORTED_SAMPLING,
    build_requests,
    engine_sampling_params,
)
from engine.entrypoints.http.protocol import GenerateReqInput
from engine.sampling.sampling_params import SamplingParams

API_DOC = Path(__file__).resolve().parents[3] / "docs" / "native-api.md"
CONTEXT_LEN = 512
CTX: Any = SimpleNamespace(context_len=CONTEXT_LEN)

# SGLang 0.5.5's GenerateReqInput and SamplingParams fields, as its io_struct.py and
# sampling_params.py declare them (the version the table follows).
SGLANG_REQUEST_FIELDS = {
    "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "sampling_params",
    "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs",
    "stream", "log_metrics", "return_hidden_states", "modalities", "session_params", "lora_path", "lora_id",
    "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
    "validation_time", "data_parallel_rank", "background", "conversation_id", "rid", "priority", "extra_key",
    "no_logs", "custom_labels", "return_bytes", "return_entropy",
}
SGLANG_SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "custom_params", "stream_interval", "logit_bias", "sampling_seed",
}


def _parse(body: dict[str, Any]) -> GenerateReqInput:
    return parse_body(json.dumps(body).encode(), GenerateReqInput)


def _error(body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as info:
        build_requests(CTX, _parse(body))
    return info.value


def test_every_sglang_field_has_exactly_one_fate() -> None:
    unsupported = [spec.name for spec in UNSUPPORTED_FIELDS]
    fates = list(ACTING_FIELDS) + list(IGNORED_FIELDS) + unsupported
    assert len(fates) == len(set(fates))
    assert set(fates) == SGLANG_REQUEST_FIELDS == set(GenerateReqInput.model_fields)
    sampling = set(SamplingParams.FIELDS) | {spec.name for spec in UNSUPPORTED_SAMPLING} | {"sampling_seed"}
    assert SGLANG_SAMPLING_FIELDS <= sampling


def test_every_field_is_in_the_api_doc() -> None:
    doc = API_DOC.read_text()
    section = doc[doc.index("## `POST /generate`"):doc.index("## Control and observability")]
    named = set(re.findall(r"`([a-z_]+)`", section))
    missing = (SGLANG_REQUEST_FIELDS | SGLANG_SAMPLING_FIELDS) - named
    assert not missing, f"docs/native-api.md does not name these /generate fields: {sorted(missing)}"


def test_off_values_are_accepted() -> None:
    body: dict[str, Any] = {"text": "hi", "lora_path": None, "lora_id": [None], "image_data": [], "modalities": None,
                            "return_hidden_states": False, "data_parallel_rank": 0, "log_metrics": True,
                            "session_params": {}, "custom_labels": None, "background": False, "return_entropy": False,
                            "validation_time": 0.5, "conversation_id": "c1", "no_logs": True,
                            "return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None,
                            "stream": None, "return_text_in_logprobs": None}
    (prompt,), copies, batch = build_requests(CTX, _parse(body))
    assert (prompt.return_logprob, prompt.logprob_start_len, prompt.top_logprobs_num, prompt.stream) == (False, -1, 0, False)
    assert copies == [1] and batch is False


@pytest.mark.parametrize("field, value, feature", [
    ("audio_data", "http://x/cat.wav", "audio inputs"),
    ("input_embeds", [[0.1, 0.2]], "input embeddings"),
    ("return_hidden_states", True, "hidden states"),
    ("data_parallel_rank", 1, "data-parallel routing"),
    ("data_parallel_rank", False, "data-parallel routing"),
    ("log_metrics", False, "/metrics"),
    ("session_params", {"id": "s"}, "sessions"),
    ("bootstrap_room", 7, "disaggregation"),
    ("custom_logit_processor", "{}", "custom logit processors"),
])
def test_a_feature_this_server_lacks_is_a_400_naming_it(field: str, value: Any, feature: str) -> None:
    err = _error({"text": "hi", field: value})
    assert err.status == 400 and err.param == field and err.code == "unsupported_feature"
    assert err.message.startswith(f"{field}: {json.dumps(value)}") and feature in err.message, err.message
    assert "accepted:" in err.message


@pytest.mark.parametrize("name, value", [("stop_regex", ["x+"]), ("stream_interval", 4), ("custom_params", {"a": 1})])
def test_unsupported_sampling_params_are_a_400(name: str, value: Any) -> None:
    err = _error({"text": "hi", "sampling_params": {name: value}})
    assert err.param == f"sampling_params.{name}" and "not support" in err.message
    indexed = _error({"text": ["a", "b"], "sampling_params": [{}, {name: value}]})
    assert indexed.param == f"sampling_params[1].{name}"


def test_sampling_nulls_are_defaults_and_sglang_names_map() -> None:
    sent = {"temperature": None, "top_p": None, "json_schema": None, "regex": None, "stop_regex": None,
            "logit_bias": None, "stream_interval": 1, "custom_params": None, "max_new_tokens": 8, "sampling_seed": 42}
    assert engine_sampling_params(sent, CONTEXT_LEN, "sampling_params") == {"max_new_tokens": 8, "seed": 42}
    # Structured output and logit_bias reach the engine's SamplingParams, which checks them.
    grammar = {"json_schema": '{"type": "object"}', "logit_bias": {"5": 1.0}}
    assert engine_sampling_params(grammar, CONTEXT_LEN, "sampling_params") == grammar
    # SGLang's max_new_tokens null: until the context is full (the scheduler caps it per prompt).
    assert engine_sampling_params({"max_new_tokens": None}, CONTEXT_LEN, "sampling_params") == {
        "max_new_tokens": CONTEXT_LEN}
    assert engine_sampling_params({"seed": 3, "sampling_seed": 3}, CONTEXT_LEN, "sp") == {"seed": 3}
    with pytest.raises(APIError, match="sampling_seed: 4 contradicts seed 3"):
        engine_sampling_params({"seed": 3, "sampling_seed": 4}, CONTEXT_LEN, "sampling_params")
    SamplingParams.from_dict(engine_sampling_params(sent, CONTEXT_LEN, "sampling_params"))


def test_logprob_fields_take_one_value_per_prompt() -> None:
    body = {"input_ids": [[1, 2], [3, 4], [5]], "return_logprob": [True, False, True],
            "logprob_start_len": [0, -1, 0], "top_logprobs_num": 2, "rid": ["a", "b", "c"]}
    prompts, _, batch = build_requests(CTX, _parse(body))
    assert batch and [(p.return_logprob, p.logprob_start_len, p.top_logprobs_num, p.rid) for p in prompts] == [
        (True, 0, 2, "a"), (False, -1, 2, "b"), (True, 0, 2, "c")]
    err = _error({"text": ["a", "b"], "return_logprob": [True]})
    assert err.param == "return_logprob" and "1 entries for 2 prompts" in err.message


def test_sglang_bench_serving_body_parses() -> None:
    # What SGLang's bench_serving sends to /generate with its defaults (--backend sglang).
    body = {"text": "hello", "sampling_params": {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True},
            "stream": True, "lora_path": None, "return_logprob": False, "logprob_start_len": -1}
    (prompt,), _, _ = build_requests(CTX, _parse(body))
    assert prompt.sampling_params == {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    assert prompt.stream and not prompt.return_logprob
