"""``SchedulePolicyConformance``: a policy orders a queue deterministically, as a permutation,
and never changes what requests generate."""

from __future__ import annotations

import random
from typing import Any, ClassVar

import pytest

from engine import plugins


class SchedulePolicyConformance:
    """Set ``policy_name``. The order must be a deterministic permutation of the queue."""

    policy_name: ClassVar[str] = ""

    def _queue(self, seed: int) -> list[Any]:
        from engine.managers.schedule_batch import Req
        from engine.sampling.sampling_params import SamplingParams

        rng = random.Random(seed)
        reqs = []
        for i in range(20):
            r = Req(f"r{i}", [rng.randrange(100) for _ in range(rng.randint(1, 50))],
                    SamplingParams(max_new_tokens=rng.randint(1, 64)), set(), priority=rng.randint(0, 3))
            r.prefix_len_hint = rng.randint(0, len(r.origin_input_ids))
            reqs.append(r)
        return reqs

    def _policy(self) -> Any:
        spec = plugins.get_schedule_policy(self.policy_name)
        policy = plugins.create(spec.factory, options=plugins.declared_options("policy", spec.name))
        policy.cache_aware = spec.cache_aware
        return policy

    @pytest.fixture(scope="class")
    @classmethod
    def tiny_checkpoint(cls, tmp_path_factory: pytest.TempPathFactory) -> str:
        from engine.testing.checkpoints import make_tiny_checkpoint

        return make_tiny_checkpoint(str(tmp_path_factory.mktemp("policy-model")), "LlamaForCausalLM")

    def _run_scheduler(self, path: str, policy: str) -> list[list[int]]:
        from engine.testing.harness import OutputCollector, generate_greedy, make_scheduler, submit

        shared = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
        prompts = [[40, 41, 42], shared + [1, 2, 3], [40, 41, 43, 44], shared + [1, 2, 4, 5],
                   shared[:4] + [60], shared + [30, 31]]
        # Two at a time, so the order matters across several prefill rounds.
        sched = make_scheduler(path, schedule_policy=policy, max_total_tokens=4096, max_running_requests=2)
        generate_greedy(sched, [shared + [1, 2]], 2)  # prefix hits for cache-aware policies
        col = OutputCollector()
        rids = [submit(sched, p, {"max_new_tokens": 4 + 2 * i, "temperature": 0, "ignore_eos": True},
                       priority=i % 3) for i, p in enumerate(prompts)]
        while sched.step():
            col.collect(sched)
        col.collect(sched)
        return [col.ids[r] for r in rids]

    def test_greedy_outputs_match_fcfs(self, tiny_checkpoint: str) -> None:
        """Order changes when requests run, never what they generate."""
        got = self._run_scheduler(tiny_checkpoint, self.policy_name)
        assert got == self._run_scheduler(tiny_checkpoint, "fcfs")
        assert [len(ids) for ids in got] == [4 + 2 * i for i in range(6)]

    def test_orders_deterministically(self) -> None:
        from engine.managers.policy import PolicyContext

        queue = self._queue(7)
        first = self._policy().order(list(queue), PolicyContext())
        second = self._policy().order(list(queue), PolicyContext())
        assert [r.rid for r in first] == [r.rid for r in second]
        assert sorted(r.rid for r in first) == sorted(r.rid for r in queue), "order() must return a permutation"
