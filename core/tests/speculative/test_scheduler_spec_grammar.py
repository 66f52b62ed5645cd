"""Structured output under speculation: constrained rows take no drafts and decode through the
grammar mask in the same forward as the drafting rows; every output equals speculation off."""

from __future__ import annotations

import json
import random
from typing import Any

from engine.managers.scheduler import check_no_leak
from engine.testing.harness import OutputCollector, make_scheduler, submit

SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "n"]}


def _run(sched: Any, jobs: list[tuple[list[int], dict[str, Any]]]) -> list[list[int]]:
    rids = [submit(sched, p, sp) for p, sp in jobs]
    col = OutputCollector()
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    return [col.ids[r] for r in rids]


def test_constrained_rows_beside_drafting_rows(llama_ckpt: str) -> None:
    rng = random.Random(4)
    phrase = [rng.randrange(4, 2048) for _ in range(10)]
    jobs = [([rng.randrange(4, 2048) for _ in range(9)],
             {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(SCHEMA)}),
            ([rng.randrange(4, 2048) for _ in range(14)],
             {"max_new_tokens": 40, "temperature": 1.0, "seed": 3, "json_schema": json.dumps(SCHEMA)}),
            ([rng.randrange(4, 2048) for _ in range(6)], {"max_new_tokens": 12, "temperature": 0, "regex": r"[0-9]{3}-[a-z]{2}"}),
            (phrase * 4, {"max_new_tokens": 24, "temperature": 0}),
            (phrase[:5] * 3, {"max_new_tokens": 24, "temperature": 0})]
    want = _run(make_scheduler(llama_ckpt), jobs)
    sched = make_scheduler(llama_ckpt, speculative_algorithm="ngram", speculative_num_steps=5)
    assert _run(sched, jobs) == want
    assert sched.speculator.stats.verify_steps > 0
    check_no_leak(sched)
