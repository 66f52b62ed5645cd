"""Structured output on a CUDA GPU (run by the lead): CUDA graphs, the overlap scheduler and both
grammar backends' batched mask on the device.

- A batch mixing JSON-schema, regex and unconstrained requests, with CUDA graphs and overlap on
  (the server's defaults on CUDA): constrained outputs are in their language, the unconstrained
  ones equal the same requests run alone, and the result equals graphs off / overlap off.
- Each backend's ``apply_bitmask`` on CUDA equals the portable mask.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from engine.testing.harness import OutputCollector, generate_greedy, make_scheduler, submit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("xgrammar")

EOS = 3
SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          # No other keys: llguidance follows JSON Schema's default (extra properties allowed), and a
          # random model then writes long keys past max_new_tokens; xgrammar is strict by default.
          "required": ["color", "ok", "n"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2}"
_SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("grammar_gpu")), "LlamaForCausalLM", dtype="bfloat16",
                                **_SHAPE)


def _jobs() -> list[tuple[list[int], dict[str, Any]]]:
    prompts = [list(range(5 + 7 * i, 30 + 7 * i)) for i in range(8)]
    jobs = []
    for i, p in enumerate(prompts):
        if i % 3 == 0:
            jobs.append((p, {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(SCHEMA)}))
        elif i % 3 == 1:
            jobs.append((p, {"max_new_tokens": 12, "temperature": 0, "regex": REGEX}))
        else:
            jobs.append((p, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}))
    return jobs


def _run(sched: Any, jobs: list[tuple[list[int], dict[str, Any]]]) -> tuple[list[list[int]], list[Any]]:
    col = OutputCollector()
    rids = [submit(sched, p, sp) for p, sp in jobs]
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    return [col.ids[r] for r in rids], [col.finish[r] for r in rids]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_constrained_batch_with_cuda_graphs_and_overlap(ckpt: str, backend: str) -> None:
    import jsonschema
    from transformers import AutoTokenizer

    pytest.importorskip(backend)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    jobs = _jobs()
    sched = make_scheduler(ckpt, platform="cuda", dtype="bfloat16", grammar_backend=backend)
    assert sched.enable_overlap and sched.runner.cuda_graph_runner is not None
    ids, finish = _run(sched, jobs)
    assert sched.overlapped_decode_steps > 0
    plain = make_scheduler(ckpt, platform="cuda", dtype="bfloat16", grammar_backend=backend,
                           disable_cuda_graph=True, disable_overlap_schedule=True)
    assert _run(plain, jobs)[0] == ids, "CUDA graphs / overlap changed constrained outputs"
    for (prompt, params), out, reason in zip(jobs, ids, finish):
        text = tokenizer.decode([t for t in out if t != EOS])
        if "json_schema" in params:
            assert reason["type"] == "stop", reason
            jsonschema.validate(json.loads(text), SCHEMA)
        elif "regex" in params:
            assert re.fullmatch(REGEX, text), text
        else:
            alone = generate_greedy(make_scheduler(ckpt, platform="cuda", dtype="bfloat16"), [prompt], 16,
                                    ignore_eos=True)[0]
            assert out == alone, "a grammar mask leaked into an unconstrained row"


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_apply_bitmask_on_cuda_matches_portable(backend: str) -> None:
    import os

    from transformers import AutoTokenizer

    from engine import plugins
    from engine.constrained import TokenizerInfo, apply_token_bitmask

    pytest.importorskip(backend)
    tok = AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(plugins.__file__), "testing", "tiny_tokenizer"))
    impl = plugins.create_grammar_backend(backend, TokenizerInfo(tok, 2112, (3,)))
    gen = torch.Generator().manual_seed(0)
    for rows, vocab in ((1, 2112), (64, 2112), (64, 49152)):
        bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), generator=gen).to(torch.int32).cuda()
        logits = torch.randn(rows, vocab, generator=gen).cuda()
        want = logits.clone()
        apply_token_bitmask(want, bitmask)
        impl.apply_bitmask(logits, bitmask)
        assert torch.equal(logits, want)
