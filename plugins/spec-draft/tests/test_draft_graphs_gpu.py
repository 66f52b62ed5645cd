"""The draft model's decode steps in CUDA graphs (run by the lead on a GPU): on tiny float32
checkpoints with the triton backend, a draft runner that replays captured graphs proposes exactly
the drafts of one that runs eagerly (--disable-cuda-graph), batches padded to buckets included,
and both give the plain greedy output; draft = target is accepted in full; in bf16 with each CUDA
attention backend the output equals plain decoding up to near-ties. No KV leaks."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from engine.managers.scheduler import check_no_leak
from engine.testing.harness import (
    assert_equal_up_to_near_ties,
    cuda_attention_backends,
    generate_greedy,
    make_scheduler,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

_SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("draft_graphs_target")), "LlamaForCausalLM", **_SHAPE)


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("draft_graphs_draft")), "LlamaForCausalLM", seed=3,
                                num_hidden_layers=1, **_SHAPE)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(8)
    phrase = [rng.randrange(1000) for _ in range(20)]
    return [phrase * 4, [rng.randrange(1000) for _ in range(9)], phrase[:7] * 6 + [1, 2, 3],
            [rng.randrange(1000) for _ in range(150)], phrase * 2 + phrase[:10]]


def _sched(ckpt: str, **kw: Any) -> Any:
    kw.setdefault("dtype", "float32")  # CUDA's --dtype auto is bf16: exact equalities hold in float32
    kw.setdefault("attention", "triton")
    kw.setdefault("plugin_options", {"draft": {"cuda_graph": True}})  # explicit: these tests are about them
    return make_scheduler(ckpt, platform="cuda", max_total_tokens=20000, **kw)


def _recorded(sched: Any) -> tuple[list[Any], list[int]]:
    """Records every round's drafts and the batch size of every draft graph replay."""
    proposer = sched.speculator.proposer
    rounds: list[Any] = []
    replays: list[int] = []
    propose = proposer.propose

    def recording_propose(reqs: Any) -> Any:
        out = propose(reqs)
        rounds.append(out)
        return out

    proposer.propose = recording_propose
    graphs = proposer.runner.cuda_graph_runner
    if graphs is not None:
        replay = graphs.replay

        def counting_replay(fb: Any) -> Any:
            replays.append(fb.batch_size)
            return replay(fb)

        graphs.replay = counting_replay
    return rounds, replays


def test_draft_graphs_propose_what_eager_steps_propose(target: str, draft: str, prompts: list[list[int]]) -> None:
    plain = generate_greedy(_sched(target), prompts, 40)
    spec = dict(speculative_algorithm="draft", speculative_draft_model_path=draft, speculative_num_steps=4)
    graphed, eager = _sched(target, **spec), _sched(target, disable_cuda_graph=True, **spec)
    runner = graphed.speculator.proposer.runner
    assert runner.cuda_graph_runner is not None and runner.cuda_graph_runner.batch_sizes == [1, 2, 4, 8]
    assert eager.speculator.proposer.runner.cuda_graph_runner is None
    (g_rounds, g_replays), (e_rounds, _) = _recorded(graphed), _recorded(eager)
    for batch in (prompts, prompts[:3], prompts[:1]):  # 5 and 3 rows pad to buckets 8 and 4
        want = [plain[prompts.index(p)] for p in batch]
        assert generate_greedy(graphed, batch, 40) == want
        assert generate_greedy(eager, batch, 40) == want
    assert g_rounds == e_rounds and any(any(d) for d in g_rounds)
    assert {1, 3, 5} <= set(g_replays)
    assert graphed.speculator.proposer.decode_forwards == len(g_replays)
    check_no_leak(graphed)
    check_no_leak(eager)


def test_draft_equal_to_target_accepted_in_full_with_graphs(target: str, prompts: list[list[int]]) -> None:
    sched = _sched(target, speculative_algorithm="draft", speculative_draft_model_path=target,
                   speculative_num_steps=5)
    _, replays = _recorded(sched)
    generate_greedy(sched, prompts, 36, ignore_eos=True)
    st = sched.speculator.stats
    # Same weights, float32: the draft's decode graphs and the target's verify extend agree.
    assert st.accepted_tokens >= 0.98 * st.proposed_tokens > 0, st
    assert replays
    check_no_leak(sched)


@pytest.mark.parametrize("attention", cuda_attention_backends())
def test_draft_graphs_in_bf16_equal_plain_up_to_near_ties(target: str, draft: str, prompts: list[list[int]],
                                                          attention: str) -> None:
    expected = generate_greedy(_sched(target, dtype="auto", attention=attention), prompts, 40)
    sched = _sched(target, dtype="auto", attention=attention, speculative_algorithm="draft",
                   speculative_draft_model_path=draft, speculative_num_steps=4)
    _, replays = _recorded(sched)
    got = generate_greedy(sched, prompts, 40)
    assert replays, f"the draft runner replayed no graph with {attention}"
    check_no_leak(sched)
    assert_equal_up_to_near_ties(sched, prompts, expected, got)
