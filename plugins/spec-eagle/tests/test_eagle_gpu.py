"""EAGLE on the GPU (for the lead): random EAGLE-1 and EAGLE-3 heads built for the default model
give its plain greedy output (float32; bf16: up to near-ties) with each CUDA attention backend
(CUDA graphs on), as chains and as EAGLE-2 trees (top-k 4); a head that copies a tiny bigram
target is accepted in full on the device, and along its best path with a tree."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from engine.managers.scheduler import check_no_leak
from engine.testing.default_model import CHATS, chat_prompt_ids
from engine.testing.harness import (
    assert_equal_up_to_near_ties,
    generate_greedy,
    make_scheduler,
)
from engine_spec_eagle.testing import make_bigram_target, make_copying_eagle_head, make_eagle_head

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def model_dir() -> str:
    from engine.model_executor.checkpoint import resolve_checkpoint

    return resolve_checkpoint(None)


@pytest.fixture(scope="module")
def prompts(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(model_dir)
    return [chat_prompt_ids(tok, chat) for chat in CHATS]


BACKENDS = [
    ("triton", "float32"), ("triton", "bfloat16"),
    pytest.param("flashinfer", "bfloat16", marks=[] if importlib.util.find_spec("flashinfer") else
                 [pytest.mark.skip(reason="flashinfer is not installed")]),
]


@pytest.mark.parametrize("topk", [1, 4])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("attention,dtype", BACKENDS)
def test_random_head_equals_plain_greedy(model_dir: str, prompts: list[list[int]], tmp_path: Any, kind: str,
                                         attention: Any, dtype: str, topk: int) -> None:
    # float32: equal outputs; bfloat16: equal up to near-ties (docs/speculative.md).
    head = make_eagle_head(str(tmp_path / "head"), model_dir, kind, draft_vocab_size=4096)
    kw: dict[str, Any] = dict(platform="cuda", attention=attention, dtype=dtype, max_total_tokens=20000)
    expected = generate_greedy(make_scheduler(model_dir, **kw), prompts, 48)
    tree = dict(speculative_eagle_topk=topk, speculative_num_draft_tokens=12) if topk > 1 else {}
    sched = make_scheduler(model_dir, speculative_algorithm="eagle", speculative_draft_model_path=head,
                           speculative_num_steps=4, **tree, **kw)
    got = generate_greedy(sched, prompts, 48)
    assert sched.speculator.stats.proposed_tokens > 0
    assert (sched.speculator.stats.tree_steps > 0) == (topk > 1)
    check_no_leak(sched)
    if dtype == "float32":
        assert got == expected
    else:
        assert_equal_up_to_near_ties(sched, prompts, expected, got)


def test_copying_head_is_accepted_in_full_on_the_device(tmp_path: Any) -> None:
    target = make_bigram_target(str(tmp_path / "target"))
    head = make_copying_eagle_head(str(tmp_path / "head"), target)
    prompts = [[5, 9, 33, 7], [40, 41, 42, 43, 44, 45, 46]]
    # triton: the bigram target's head_dim (16) is below what flashinfer (the CUDA default) accepts.
    plain = make_scheduler(target, platform="cuda", dtype="float32", attention="triton")
    expected = generate_greedy(plain, prompts, 32)
    sched = make_scheduler(target, platform="cuda", dtype="float32", attention="triton",
                           speculative_algorithm="eagle",
                           speculative_draft_model_path=head, speculative_num_steps=4)
    assert generate_greedy(sched, prompts, 32) == expected
    st = sched.speculator.stats
    assert st.accepted_tokens == st.proposed_tokens > 0


def test_copying_head_tree_follows_the_best_path_on_the_device(tmp_path: Any) -> None:
    target = make_bigram_target(str(tmp_path / "target"), lm_head_scale=40.0)  # peaked: the best path dominates
    head = make_copying_eagle_head(str(tmp_path / "head"), target)
    prompts = [[5, 9, 33, 7], [40, 41, 42, 43, 44, 45, 46]]
    kw: dict[str, Any] = dict(platform="cuda", dtype="float32", attention="triton")
    expected = generate_greedy(make_scheduler(target, **kw), prompts, 32)
    sched = make_scheduler(target, speculative_algorithm="eagle", speculative_draft_model_path=head,
                           speculative_num_steps=4, speculative_eagle_topk=2, speculative_num_draft_tokens=8, **kw)
    assert generate_greedy(sched, prompts, 32) == expected
    st = sched.speculator.stats
    assert st.tree_steps > 0 and st.mean_accept_length() > 4.0
    check_no_leak(sched)
