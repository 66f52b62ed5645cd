"""``SpeculativeProposerConformance``: a proposer returns well-formed drafts, and the engine
with it on gives exactly the output of the engine without speculation (greedy) on a tiny model."""

from __future__ import annotations

import random
from typing import Any, ClassVar

import pytest

from engine import plugins


class SpeculativeProposerConformance:
    """Set ``algorithm_name``; ``server_args`` adds flags (e.g. ``speculative_draft_model_path``
    for a proposer with a model of its own; it may name the fixture ``tiny_model_path``'s
    directory, which the kit builds: a random tiny Llama with the shared test tokenizer)."""

    algorithm_name: ClassVar[str] = ""
    server_args: ClassVar[dict[str, Any]] = {}
    seed: ClassVar[int] = 1234
    vocab_size: ClassVar[int] = 2048

    @pytest.fixture(scope="class")
    def tiny_model_path(self, tmp_path_factory: Any) -> str:
        from engine.testing.checkpoints import make_tiny_checkpoint

        return make_tiny_checkpoint(str(tmp_path_factory.mktemp("spec_kit")), "LlamaForCausalLM")

    def _args(self, path: str) -> dict[str, Any]:
        args = {k: (path if v == "{tiny_model_path}" else v) for k, v in self.server_args.items()}
        return {"speculative_algorithm": self.algorithm_name, **args}

    def _proposer(self, path: str) -> Any:
        from engine.config import ServerArgs
        from engine.speculative import ProposerContext

        args = ServerArgs.from_dict({"model_path": path, "platform": "cpu", **self._args(path)})
        ctx = ProposerContext(num_steps=args.speculative_num_steps, num_draft_tokens=args.speculative_num_steps + 1,
                              eagle_topk=1, vocab_size=self.vocab_size, device="cpu", target_model_path=path,
                              draft_model_path=args.speculative_draft_model_path, server_args=args)
        return plugins.create_proposer(self.algorithm_name, ctx)

    def _prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        phrase = [rng.randrange(self.vocab_size) for _ in range(12)]
        return [phrase * 4 + [rng.randrange(self.vocab_size) for _ in range(5)],  # repeats: drafts likely
                [rng.randrange(self.vocab_size) for _ in range(3)],
                [rng.randrange(self.vocab_size) for _ in range(57)],
                phrase + phrase[:6]]

    def test_spec(self) -> None:
        spec = plugins.get_speculative_algorithm(self.algorithm_name)
        assert spec.name == self.algorithm_name
        assert set(spec.draft_shapes) <= {"chain", "tree"} and spec.draft_shapes

    def test_drafts_are_well_formed(self, tiny_model_path: str) -> None:
        """One list (a chain) or ``DraftTree`` (only for a spec whose ``draft_shapes`` has
        "tree"; parents in range and before their children) per request, each within its
        ``max_draft``, every id inside the vocabulary; ``max_draft`` 0 gets nothing."""
        from engine.speculative import DraftRequest, DraftTree, Proposer

        proposer = self._proposer(tiny_model_path)
        assert isinstance(proposer, Proposer), f"the factory returned {type(proposer).__name__}, not a Proposer"
        rng = random.Random(self.seed)
        for round_ in range(3):
            reqs = [DraftRequest(f"r{i}", prompt, [rng.randrange(self.vocab_size) for _ in range(round_ * 3 + 1)],
                                 max_draft=[0, 1, 4, 7][i % 4])
                    for i, prompt in enumerate(self._prompts())]
            drafts = proposer.propose(reqs)
            assert isinstance(drafts, list) and len(drafts) == len(reqs)
            shapes = plugins.get_speculative_algorithm(self.algorithm_name).draft_shapes
            for req, d in zip(reqs, drafts):
                if isinstance(d, DraftTree):
                    assert "tree" in shapes, f"a DraftTree from a spec with draft_shapes={shapes!r}"
                    assert len(d.parents) == len(d.tokens), (req.rid, d)
                    assert all(-1 <= p < i for i, p in enumerate(d.parents)), (req.rid, d)
                    d = d.tokens
                assert len(d) <= req.max_draft, (req.rid, d)
                assert all(isinstance(t, int) and 0 <= t < self.vocab_size for t in d), d
            proposer.on_verified(reqs, [0] * len(reqs))
        for i in range(len(self._prompts())):
            proposer.release(f"r{i}")

    def test_lossless_greedy(self, tiny_model_path: str) -> None:
        """The engine with this proposer equals the engine without speculation, token for token
        (a batch of different lengths, then the same prompts again: prefix-cache hits), and
        leaks no KV slot."""
        from engine.managers.scheduler import check_no_leak
        from engine.testing.harness import generate_greedy, make_scheduler

        prompts = self._prompts()
        plain = make_scheduler(tiny_model_path)
        expected = generate_greedy(plain, prompts, 24)
        spec = make_scheduler(tiny_model_path, **self._args(tiny_model_path))
        assert spec.speculator is not None
        for _ in range(2):
            assert generate_greedy(spec, prompts, 24) == expected
        check_no_leak(spec)
