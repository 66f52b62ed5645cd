"""Structured output under tensor parallelism on the CPU (gloo, one process per rank).

The ranks compile grammars on their own threads but must admit constrained requests in the same
step (rank 0's view decides), or their lockstep breaks. The checkpoint's vocabulary (2051 rows,
padded for TP) is wider than its tokenizer's 2048 tokens: the extra columns must never be sampled.
One rank's outputs, the reference, come from a scheduler in the test's own process (no rank
processes to start).
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


def _one_rank(ckpt: str, jobs: list[tuple[list[int], dict[str, Any]]], together: bool) -> list[list[int]]:
    """Greedy output ids of one rank's scheduler, in-process: the jobs one after another, or all at once."""
    from engine.testing.harness import OutputCollector, make_scheduler, submit

    sched = make_scheduler(ckpt, max_total_tokens=512)
    col = OutputCollector()
    rids: list[str] = []
    for batch in [jobs] if together else [[job] for job in jobs]:
        rids += [submit(sched, p, sp) for p, sp in batch]
        while sched.step():
            col.collect(sched)
        col.collect(sched)
    return [col.ids[r] for r in rids]


SEQUENTIAL = [([5, 6, 7, 8], {"max_new_tokens": 30, "temperature": 0, "json_schema": json.dumps(SCHEMA)}),
              ([40, 41, 42], {"max_new_tokens": 10, "temperature": 0, "regex": REGEX}),
              ([300, 301, 302, 303, 304], {"max_new_tokens": 6, "temperature": 0})]
TOGETHER = [*SEQUENTIAL, ([9, 10], {"max_new_tokens": 12, "temperature": 0})]


def test_constrained_requests_under_tp2_equal_tp1(ckpt: str) -> None:
    import jsonschema

    with Engine(model_path=ckpt, max_total_tokens=512, log_level="warning", tp_size=2) as eng:
        tp2 = [eng.generate(input_ids=p, sampling_params=sp) for p, sp in SEQUENTIAL]
    assert [o["output_ids"] for o in tp2] == _one_rank(ckpt, SEQUENTIAL, together=False)
    jsonschema.validate(json.loads(tp2[0]["text"]), SCHEMA)
    assert re.fullmatch(REGEX, tp2[1]["text"]), tp2[1]["text"]
    assert all(t < 2048 for o in tp2 for t in o["output_ids"])


def test_constrained_requests_in_pp2_micro_batches_equal_one_rank(ckpt: str) -> None:
    """Constrained rows in micro-batches in flight beside plain ones: each grammar sees its last
    token before its next micro-batch's mask is filled on the last stage."""
    with Engine(model_path=ckpt, max_total_tokens=512, log_level="warning", pp_size=2) as eng:
        pp2 = eng.generate(input_ids=[p for p, _ in TOGETHER], sampling_params=[sp for _, sp in TOGETHER])
    assert [o["output_ids"] for o in pp2] == _one_rank(ckpt, TOGETHER, together=True)
    assert re.fullmatch(REGEX, pp2[1]["text"]), pp2[1]["text"]
