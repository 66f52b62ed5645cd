"""Structured output under tensor parallelism on the CPU (gloo, one process per rank).

The ranks compile grammars on their own threads but must admit constrained requests in the same
step (rank 0's view decides), or their lockstep breaks. The checkpoint's vocabulary (2051 rows,
padded for TP) is wider than its tokenizer's 2048 tokens: the extra columns must never be sampled.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from engine import Engine
from engine.testing.checkpoints import make_tiny_checkpoint

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}}, "required": ["k", "n"]}
REGEX = r"[a-z]{2}[0-9]{2}"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tp-grammar")), "LlamaForCausalLM",
                                vocab_size=2051, num_key_value_heads=1, num_hidden_layers=2)


def _generate(ckpt: str, **kw: Any) -> list[dict[str, Any]]:
    prompts = [[5, 6, 7, 8], [40, 41, 42], [300, 301, 302, 303, 304]]
    params = [{"max_new_tokens": 30, "temperature": 0, "json_schema": json.dumps(SCHEMA)},
              {"max_new_tokens": 10, "temperature": 0, "regex": REGEX},
              {"max_new_tokens": 6, "temperature": 0}]
    with Engine(model_path=ckpt, max_total_tokens=512, log_level="warning", **kw) as eng:
        return [eng.generate(input_ids=p, sampling_params=sp) for p, sp in zip(prompts, params)]


def test_constrained_requests_under_tp2_equal_tp1(ckpt: str) -> None:
    import jsonschema

    single = _generate(ckpt)
    tp2 = _generate(ckpt, tp_size=2)
    assert [o["output_ids"] for o in tp2] == [o["output_ids"] for o in single]
    jsonschema.validate(json.loads(tp2[0]["text"]), SCHEMA)
    assert re.fullmatch(REGEX, tp2[1]["text"]), tp2[1]["text"]
    assert all(t < 2048 for o in tp2 for t in o["output_ids"])


def _generate_together(ckpt: str, **kw: Any) -> list[dict[str, Any]]:
    prompts = [[5, 6, 7, 8], [40, 41, 42], [300, 301, 302, 303, 304], [9, 10]]
    params = [{"max_new_tokens": 30, "temperature": 0, "json_schema": json.dumps(SCHEMA)},
              {"max_new_tokens": 10, "temperature": 0, "regex": REGEX},
              {"max_new_tokens": 6, "temperature": 0},
              {"max_new_tokens": 12, "temperature": 0}]
    with Engine(model_path=ckpt, max_total_tokens=512, log_level="warning", **kw) as eng:
        return eng.generate(input_ids=prompts, sampling_params=params)


def test_constrained_requests_in_pp2_micro_batches_equal_one_rank(ckpt: str) -> None:
    """Constrained rows in micro-batches in flight beside plain ones: each grammar sees its last
    token before its next micro-batch's mask is filled on the last stage."""
    single = _generate_together(ckpt)
    pp2 = _generate_together(ckpt, pp_size=2)
    assert [o["output_ids"] for o in pp2] == [o["output_ids"] for o in single]
    assert re.fullmatch(REGEX, pp2[1]["text"]), pp2[1]["text"]
