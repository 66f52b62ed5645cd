"""Tree drafts inside the scheduler, on a tiny random Llama (CPU): exact greedy output with an
oracle tree proposer (the target's continuation on one branch, random decoys on the others) and
a random one, with torch_native and triton (under Triton's interpreter), prefix-cache hits and
chunked prefill; more accepted than the longest-chain fall-back; no KV leak; hidden states of
the accepted path; malformed trees refused."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch

from engine.managers.scheduler import check_no_leak
from engine.speculative import DraftRequest, DraftTree, Proposer
from engine.speculative.tree import longest_chain
from engine.testing.harness import generate_greedy, make_scheduler
from engine.testing.proposers import OracleTreeProposer, RandomTreeProposer

VOCAB = 2048
_NO_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
BACKENDS = ["torch_native", pytest.param("triton", marks=pytest.mark.skipif(
    _NO_INTERPRETER, reason="triton runs on the CPU only under TRITON_INTERPRET=1"))]
# Through Triton's interpreter the random-tree run takes about a minute: on a CPU the oracle tree
# covers the triton tree path (test_triton_interpreter its kernels); the GPU sweep runs both.
BACKENDS_GPU_SWEEP = ["torch_native", pytest.param("triton", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (about a minute in Triton's interpreter)")])]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(11)
    phrase = [rng.randrange(VOCAB) for _ in range(16)]
    return [phrase * 3, [rng.randrange(VOCAB) for _ in range(5)], [rng.randrange(VOCAB) for _ in range(40)],
            phrase[:9] + [3, 4] * 6]


_expected: dict[str, list[list[int]]] = {}


def _plain(path: str, attention: str, prompts: list[list[int]]) -> list[list[int]]:
    key = f"{attention}/{len(prompts)}"
    if key not in _expected:
        _expected[key] = generate_greedy(make_scheduler(path, attention=attention), prompts, 20)
    return _expected[key]


def _spec(path: str, proposer: Proposer, attention: str = "torch_native", **kw: Any) -> Any:
    kw.setdefault("speculative_num_steps", 4)
    kw.setdefault("speculative_num_draft_tokens", 11)
    sched = make_scheduler(path, speculative_algorithm="ngram", attention=attention, **kw)
    sched.speculator.proposer = proposer
    return sched


@pytest.mark.parametrize("attention", BACKENDS)
def test_oracle_tree_exact_with_prefix_hits_and_chunking(llama_ckpt: str, prompts: list[list[int]],
                                                         attention: str) -> None:
    if attention == "triton" and not torch.cuda.is_available():
        # Triton's interpreter: the two prompts that share a prefix (the 48-token one is chunked).
        prompts = [prompts[0], prompts[3]]
    expected = _plain(llama_ckpt, attention, prompts)
    sched = _spec(llama_ckpt, OracleTreeProposer(prompts, expected, depth=4), attention, chunked_prefill_size=16)
    for _ in range(2):  # the second round hits the prefix cache
        assert generate_greedy(sched, prompts, 20) == expected
    st = sched.speculator.stats
    assert st.tree_steps > 0
    # The right branch (4 drafts) is kept in full wherever the budget allows: 19 decode tokens
    # per request in runs of 5, the last run shorter.
    assert st.mean_accept_length() > 4.0
    check_no_leak(sched)


@pytest.mark.parametrize("attention", BACKENDS_GPU_SWEEP)
def test_random_tree_exact(llama_ckpt: str, prompts: list[list[int]], attention: str) -> None:
    expected = _plain(llama_ckpt, attention, prompts)
    sched = _spec(llama_ckpt, RandomTreeProposer(3), attention, chunked_prefill_size=32)
    assert generate_greedy(sched, prompts, 20) == expected
    assert sched.speculator.stats.tree_steps > 0
    check_no_leak(sched)


def test_tree_accepts_more_than_the_chain_fall_back(llama_ckpt: str, prompts: list[list[int]]) -> None:
    """Without ``supports_tree_mask`` each tree is cut to its longest branch (the decoy here)."""
    expected = _plain(llama_ckpt, "torch_native", prompts)
    tree = _spec(llama_ckpt, OracleTreeProposer(prompts, expected, depth=4))
    assert generate_greedy(tree, prompts, 20) == expected
    chain = _spec(llama_ckpt, OracleTreeProposer(prompts, expected, depth=4))
    chain.speculator.verify_trees = False  # as on a backend without supports_tree_mask
    assert generate_greedy(chain, prompts, 20) == expected
    assert chain.speculator.stats.tree_steps == 0
    assert tree.speculator.stats.mean_accept_length() > chain.speculator.stats.mean_accept_length() + 2
    check_no_leak(tree)
    check_no_leak(chain)


def test_sampling_with_trees_frees_kv(llama_ckpt: str, prompts: list[list[int]]) -> None:
    from engine.testing.harness import OutputCollector, submit

    sched = _spec(llama_ckpt, RandomTreeProposer(5))
    rids = [submit(sched, p, {"max_new_tokens": 16, "temperature": 0.9, "top_k": 50}) for p in prompts]
    col = OutputCollector()
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    assert all(len(col.ids[r]) == 16 for r in rids)
    assert sched.speculator.stats.tree_steps > 0
    check_no_leak(sched)


def test_hidden_states_follow_the_accepted_path(llama_ckpt: str, prompts: list[list[int]]) -> None:
    """A proposer that reads hidden states gets, per verify step, the accepted path's rows in
    position order: they equal the plain forward's hidden states at those positions."""
    import torch

    expected = _plain(llama_ckpt, "torch_native", prompts)
    proposer = OracleTreeProposer(prompts, expected, depth=3, seed=4)
    sched = _spec(llama_ckpt, proposer)
    sched.speculator.wants_hidden = True
    sched.runner.capture_hidden = ()
    assert generate_greedy(sched, prompts[:1], 20) == expected[:1]
    # Reassemble the positions received; the last write of a position wins.
    got: dict[int, torch.Tensor] = {}
    for st in proposer.hidden:
        for j in range(st.hidden.shape[0]):
            got[st.start + j] = st.hidden[j]
    full = prompts[0] + expected[0]
    ref_sched = make_scheduler(llama_ckpt)
    ref_sched.runner.capture_hidden = ()
    from engine.model_executor.forward_batch import ForwardBatch, ForwardMode

    runner = ref_sched.runner
    n = len(full) - 1
    slot = runner.req_to_token_pool.alloc(1)
    loc = runner.token_to_kv_pool_allocator.alloc_extend([0], [n], [-1])
    runner.req_to_token_pool.write(slot[0], 0, loc)
    fb = ForwardBatch.build(ForwardMode.EXTEND, full[:n], slot, [n], [0], loc, runner.device, num_extend_reqs=1,
                            return_logprob=True)
    ref = runner.forward(fb).hidden_states
    decode_positions = [p for p in got if p >= len(prompts[0])]
    assert len(decode_positions) >= 10
    for p in decode_positions:
        assert torch.allclose(got[p], ref[p], atol=1e-4), p


@pytest.mark.parametrize("tree, match", [
    (DraftTree([1, 2], [-1]), "2 tokens and 1 parents"),
    (DraftTree([1, 2], [-1, 1]), "node 1 has parent 1"),
    (DraftTree([1, 2], [-1, -2]), "node 1 has parent -2"),
    (DraftTree([1, VOCAB], [-1, 0]), f"token id {VOCAB} outside the vocabulary"),
])
def test_malformed_trees_refused(tree: DraftTree, match: str) -> None:
    from engine.speculative.worker import Speculator

    with pytest.raises(RuntimeError, match=match):
        Speculator._checked([tree], [DraftRequest("r", [1], [2], 4)], VOCAB)


def test_trees_need_a_tree_mask(llama_ckpt: str) -> None:
    from engine.speculative.worker import Speculator

    sched = make_scheduler(llama_ckpt, speculative_algorithm="ngram")
    assert sched.speculator.verify_trees
    from engine.layers.radix_attention import RadixAttention

    layer = next(m for m in sched.runner.model.modules() if isinstance(m, RadixAttention))
    layer.sliding_window_size = 8  # a windowed layer: trees are cut to chains
    assert not Speculator._can_verify_trees(sched.runner)
    layer.sliding_window_size = -1
    assert Speculator._can_verify_trees(sched.runner)
    sched.runner.attn_backend.supports_tree_mask = False
    assert not Speculator._can_verify_trees(sched.runner)


def test_checked_trims_trees_and_turns_chains_into_lists() -> None:
    from engine.speculative.worker import Speculator

    view = DraftRequest("r", [1], [2], 3)
    out = Speculator._checked([DraftTree([5, 6, 7, 8], [-1, -1, 1, 2]), DraftTree([5, 6], [-1, 0])],
                              [view, view], VOCAB)
    assert out == [DraftTree([5, 6, 7], [-1, -1, 1]), [5, 6]]
    assert longest_chain(DraftTree([5, 6, 7, 8], [-1, -1, 1, 0])) == [6, 7]
