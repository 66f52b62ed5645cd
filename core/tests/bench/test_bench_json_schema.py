"""``--json-schema`` of engine bench: one-batch decodes every row under the schema (overlapped
or not); serving sends it as json_schema / response_format, one copy per request when asked."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.bench.backends import BACKENDS, RequestOptions
from engine.bench.datasets import BenchRequest
from engine.bench.json_schema import BENCH_SCHEMA, load_bench_schema

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}, "n": {"type": "integer", "maximum": 9,
                                                                          "minimum": 0}}, "required": ["a", "n"]}


@pytest.mark.parametrize("overlap", [False, True])
def test_one_batch_rows_follow_the_schema(llama_ckpt: str, overlap: bool) -> None:
    pytest.importorskip("xgrammar")
    import jsonschema
    from transformers import AutoTokenizer

    from engine.bench.one_batch import run_one
    from engine.testing.harness import make_scheduler

    tokenizer = AutoTokenizer.from_pretrained(llama_ckpt)
    result = run_one(make_scheduler(llama_ckpt), 3, 8, 40, overlap=overlap, json_schema=json.dumps(SCHEMA))
    for ids in result.output_ids:
        # JSON values one after another, each ended by EOS (3); the last may be cut by the length.
        values = tokenizer.decode(ids).split("<|im_end|>")
        assert len(values) > 2, values
        for text in values[:-1]:
            jsonschema.validate(json.loads(text), SCHEMA)


def test_serving_payloads_carry_the_schema(tmp_path: Any) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps(SCHEMA))
    schema = load_bench_schema(str(path))
    assert json.loads(schema) == SCHEMA and json.loads(load_bench_schema("")) == BENCH_SCHEMA
    req = BenchRequest("hi", 1, 4)
    opts = RequestOptions(model="m", stream=False, ignore_eos=True, extra_body={}, headers={}, json_schema=schema)
    assert BACKENDS["engine"].build_payload(req, opts)["sampling_params"]["json_schema"] == schema
    chat = BACKENDS["openai-chat"].build_payload(req, opts)["response_format"]
    assert chat["type"] == "json_schema" and chat["json_schema"]["schema"] == SCHEMA
    unique = RequestOptions(model="m", stream=False, ignore_eos=True, extra_body={}, headers={},
                            json_schema=schema, json_schema_unique=True)
    first, second = (json.loads(BACKENDS["engine"].build_payload(req, unique)["sampling_params"]["json_schema"])
                     for _ in range(2))
    assert first["title"] != second["title"] and {k: v for k, v in first.items() if k != "title"} == SCHEMA
