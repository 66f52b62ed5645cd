"""The draft proposer's decode-mode rounds against the all-EXTEND drafting they replaced, the
draft runner's settings against the target's, and its decode steps through the graph runner's
static buffers (replayed eagerly on the CPU; the real capture: test_draft_graphs_gpu.py)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from engine_spec_draft.proposer import DraftModelProposer, create, draft_server_args

from engine.managers.scheduler import check_no_leak
from engine.model_executor.forward_batch import ForwardBatch, ForwardMode
from engine.speculative import DraftRequest
from engine.testing.graphs import EagerReplayGraphs
from engine.testing.harness import generate_greedy, make_scheduler

VOCAB = 2048  # the tiny checkpoints'


class AllExtendProposer(DraftModelProposer):
    """The drafting the decode-mode rounds replaced, as the reference: every step one EXTEND
    (the first over each row's catch-up tokens, then one token per row), each step's tokens read
    on the host, rows leaving at their ``max_draft`` or at a draft outside the vocabulary."""

    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int]]:
        for rid in [rid for rid in self.states if rid not in {r.rid for r in reqs}]:
            self.release(rid)
        drafts: list[list[int]] = [[] for _ in reqs]
        active = []
        for i, req in enumerate(reqs):
            state = self._state(req.rid) if req.max_draft > 0 else None
            if state is None:
                continue
            tokens = list(req.prompt_ids) + list(req.output_ids)
            self._truncate([(state, min(state.kv_len, len(tokens) - 1))])
            state.length_at_propose = len(tokens)
            active.append((i, state, tokens[state.kv_len:]))
        while active:
            nxt = self._extend([(s, t) for _, s, t in active])
            if nxt is None:
                break
            still = []
            for (i, state, _), tok in zip(active, nxt):
                if tok < self.vocab_size:
                    drafts[i].append(tok)
                    if len(drafts[i]) < reqs[i].max_draft:
                        still.append((i, state, [tok]))
            active = still
        return drafts

    @torch.inference_mode()
    def _extend(self, rows: list[tuple[Any, list[int]]]) -> list[int] | None:
        runner = self.runner
        prefix = [s.kv_len for s, _ in rows]
        seq = [s.kv_len + len(t) for s, t in rows]
        loc = runner.token_to_kv_pool_allocator.alloc(sum(seq) - sum(prefix))
        if loc is None:
            return None
        offset = 0
        for (state, _), p, s in zip(rows, prefix, seq):
            runner.req_to_token_pool.write(state.slot, p, loc[offset: offset + s - p])
            offset += s - p
            state.kv_len = s
        fb = ForwardBatch.build(ForwardMode.EXTEND, [t for _, ts in rows for t in ts], [s.slot for s, _ in rows],
                                seq, prefix, loc, runner.device, num_extend_reqs=len(rows))
        self.extend_forwards += 1
        return torch.argmax(runner.forward(fb).next_token_logits, dim=-1).tolist()


@pytest.fixture(scope="module")
def target(tmp_path_factory: Any) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("target")), "LlamaForCausalLM")


@pytest.fixture(scope="module")
def draft(tmp_path_factory: Any) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("draft")), "LlamaForCausalLM", seed=5)


def _proposer(target: str, draft: str, cls: type = DraftModelProposer, **kw: Any) -> DraftModelProposer:
    from engine.config import ServerArgs
    from engine.speculative import ProposerContext

    args = ServerArgs.from_dict({"model_path": target, "platform": "cpu", "speculative_algorithm": "draft",
                                 "speculative_draft_model_path": draft, **kw})
    ctx = ProposerContext(num_steps=4, num_draft_tokens=5, eagle_topk=1, vocab_size=VOCAB, device="cpu",
                          target_model_path=target, draft_model_path=draft, server_args=args)
    made = create(ctx)
    return made if cls is DraftModelProposer else cls(made.runner, VOCAB)


def _drive(proposers: list[DraftModelProposer], rounds: int, seed: int) -> list[list[list[int]]]:
    """Rounds of drafting for a changing set of requests, each proposer seeing the same requests
    and acceptance; asserts equal drafts and equal draft KV after each verification. Returns
    the drafts of every round."""
    rng = random.Random(seed)
    reqs: dict[str, tuple[list[int], list[int]]] = {}
    seen = []
    for rnd in range(rounds):
        if rnd in (0, 3):  # requests arrive (different lengths) ...
            for n in (5, 31, 12, 2, 17)[: 5 if rnd == 0 else 2]:
                reqs[f"r{len(reqs)}"] = ([rng.randrange(VOCAB) for _ in range(n)], [rng.randrange(VOCAB)])
        if rnd == 4:  # ... and leave
            reqs.pop("r1")
        views = [DraftRequest(rid, p, list(o), max_draft=(4, 1, 0, 3, 2, 4, 4)[(j + rnd) % 7])
                 for j, (rid, (p, o)) in enumerate(reqs.items())]
        got = [p.propose(views) for p in proposers]
        for other in got[1:]:
            assert other == got[0], f"round {rnd}"
        drafts = got[0]
        seen.append(drafts)
        for v, d in zip(views, drafts):
            assert len(d) <= v.max_draft and all(0 <= t < proposers[0].vocab_size for t in d)
        # Round 1 rejects everything: round 2 catches up one token per row (a decode step).
        kept = [0 if rnd == 1 else rng.randint(0, len(d)) for d in drafts]
        for p in proposers:
            p.on_verified(views, kept)
        for v, d, a in zip(views, drafts, kept):
            reqs[v.rid][1].extend(d[:a] + [rng.randrange(VOCAB)])
        kv = [{rid: s.kv_len for rid, s in p.states.items()} for p in proposers]
        free = [p.runner.token_to_kv_pool_allocator.available_size() for p in proposers]
        assert all(x == kv[0] for x in kv) and len(set(free)) == 1, f"round {rnd}"
    return seen


def test_decode_rounds_equal_all_extend_drafting(target: str, draft: str) -> None:
    new, ref = _proposer(target, draft), _proposer(target, draft, AllExtendProposer)
    # A target vocabulary below the draft's: some drafts end their chain early (cut on the host).
    new.vocab_size = ref.vocab_size = 1400
    seen = _drive([new, ref], rounds=7, seed=2)
    drafts = [d for rnd in seen for d in rnd]
    assert any(0 < len(d) < 3 for d in drafts) and any(len(d) == 4 for d in drafts)
    # One EXTEND per round at most (none in round 2: a one-token catch-up), the rest DECODE.
    assert new.extend_forwards < len(seen) <= new.decode_forwards and ref.decode_forwards == 0
    for p in (new, ref):
        p.propose([])
        assert p.runner.token_to_kv_pool_allocator.available_size() == p.runner.max_total_num_tokens


def test_full_draft_pool_proposes_a_prefix(target: str, draft: str) -> None:
    """A pool that holds the catch-up but not every decode step: fewer drafts, never others."""
    roomy = _proposer(target, draft)
    tight = _proposer(target, draft, max_total_tokens=100)
    rng = random.Random(4)
    views = [DraftRequest(f"q{i}", [rng.randrange(VOCAB) for _ in range(n)], [1], max_draft=4)
             for i, n in enumerate((40, 30, 22))]  # 95 tokens to catch up in 100 slots: one decode step
    full, cut = roomy.propose(views), tight.propose(views)
    assert [len(d) for d in full] == [4, 4, 4] and [len(d) for d in cut] == [2, 2, 2]
    assert all(c == f[: len(c)] for c, f in zip(cut, full))
    tight.on_verified(views, [0, 0, 0])
    assert tight.runner.token_to_kv_pool_allocator.available_size() == 100 - 95
    views = [DraftRequest("big", [5] * 120, [1], max_draft=4)]  # no room for its catch-up
    assert tight.propose(views) == [[]]
    assert tight.runner.token_to_kv_pool_allocator.available_size() == 100  # the old requests left


def test_draft_settings_follow_the_target(target: str) -> None:
    from engine.config import ServerArgs

    base = {"model_path": target, "speculative_algorithm": "draft", "speculative_draft_model_path": "D"}
    runner = SimpleNamespace(max_total_num_tokens=500_000, context_len=8192)
    args = ServerArgs.from_dict(base)
    d = draft_server_args(args, "D", runner, num_draft_tokens=5)
    assert d.model_path == "D" and d.speculative_algorithm is None and d.quant is None
    assert d.disable_cuda_graph is False and d.cuda_graph_max_bs == 8  # graphs up to the speculation limit
    assert d.max_running_requests == 8 and d.max_total_tokens == 8 * (8192 + 5)
    args = ServerArgs.from_dict({**base, "disable_cuda_graph": True, "cuda_graph_max_bs": 2,
                                 "speculative_max_batch_size": 32})
    d = draft_server_args(args, "D", runner, num_draft_tokens=9)
    assert d.disable_cuda_graph is True and d.cuda_graph_max_bs == 2 and d.max_running_requests == 32
    small = SimpleNamespace(max_total_num_tokens=20_000, context_len=8192)
    assert draft_server_args(args, "D", small, num_draft_tokens=9).max_total_tokens == 20_000
    assert draft_server_args(ServerArgs.from_dict(base), "D", runner, 5, cuda_graph=False).disable_cuda_graph
    # Through the scheduler: the draft runner gets these settings (no device graphs on the CPU);
    # its graphs are on by default and off with --plugin-option draft.cuda_graph=false.
    spec = dict(speculative_algorithm="draft", speculative_draft_model_path=target)
    off = make_scheduler(target, plugin_options={"draft": {"cuda_graph": False}}, **spec)
    assert off.speculator.proposer.runner.args.disable_cuda_graph is True
    assert make_scheduler(target, **spec).speculator.proposer.runner.args.disable_cuda_graph is False
    with pytest.raises(ValueError, match="draft.cuda_graph: 'yes'; accepted: true or false"):
        make_scheduler(target, plugin_options={"draft": {"cuda_graph": "yes"}}, **spec)
    sched = make_scheduler(target, cuda_graph_max_bs=2, speculative_max_batch_size=4,
                           plugin_options={"draft": {"cuda_graph": True}}, **spec)
    draft_runner = sched.speculator.proposer.runner
    assert draft_runner.args.disable_cuda_graph is False and draft_runner.args.cuda_graph_max_bs == 2
    assert draft_runner.max_running_requests == 4 and draft_runner.cuda_graph_runner is None
    assert draft_runner.max_total_num_tokens == min(sched.runner.max_total_num_tokens, 4 * (1024 + 5))


def test_decode_steps_through_the_graph_runner(target: str, draft: str) -> None:
    """Decode steps replayed through the graph runner's static buffers (padded to 1, 2, 4 rows)
    draft as eager steps do, and the engine's output stays the plain one."""
    eager, graphed = _proposer(target, draft), _proposer(target, draft)
    graphs = graphed.runner.cuda_graph_runner = EagerReplayGraphs(graphed.runner, 8)
    assert graphs.batch_sizes == [1, 2, 4, 8]
    _drive([graphed, eager], rounds=6, seed=7)
    assert set(graphs.replayed) >= {1, 2, 4} and len(graphs.replayed) == graphed.decode_forwards

    rng = random.Random(9)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (7, 26, 13)]
    expected = generate_greedy(make_scheduler(target), prompts, 16)
    sched = make_scheduler(target, speculative_algorithm="draft", speculative_draft_model_path=draft,
                           speculative_num_steps=4)
    runner = sched.speculator.proposer.runner
    runner.cuda_graph_runner = EagerReplayGraphs(runner, 8)
    assert generate_greedy(sched, prompts, 16) == expected
    assert runner.cuda_graph_runner.replayed
    check_no_leak(sched)
