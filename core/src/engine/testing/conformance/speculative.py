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

    # A classmethod: pytest deprecates class-scoped fixtures defined as instance methods.
    @pytest.fixture(scope="class")
    @classmethod
    def tiny_model_path(cls, tmp_path_factory: Any) -> str:
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
        ``max_draft``, every id inside the vocabulary; ``max_draft`` 0 gets nothing. The
        requests live as the engine's do: each id is new, its output grows between steps, and
        it ends with ``on_request_end`` and ``release(rid, "finished")``; releasing an id never
        proposed for (a request that ended in its prefill) is harmless."""
        from engine.hookspecs import call_with_accepted
        from engine.speculative import DraftRequest, DraftTree, Proposer, RequestEnd

        proposer = self._proposer(tiny_model_path)
        assert isinstance(proposer, Proposer), f"the factory returned {type(proposer).__name__}, not a Proposer"
        shapes = plugins.get_speculative_algorithm(self.algorithm_name).draft_shapes
        rng = random.Random(self.seed)
        prompts = self._prompts()
        outputs = [[rng.randrange(self.vocab_size)] for _ in prompts]
        rids = [f"kit-{self.seed}-{i}" for i in range(len(prompts))]
        for step in range(3):
            reqs = [DraftRequest(rid, prompt, list(out), max_draft=[0, 1, 4, 7][i % 4])
                    for i, (rid, prompt, out) in enumerate(zip(rids, prompts, outputs))]
            drafts = proposer.propose(reqs)
            assert isinstance(drafts, list) and len(drafts) == len(reqs), (
                f"step {step}: propose() returned {type(drafts).__name__} of "
                f"{len(drafts) if hasattr(drafts, '__len__') else '?'} entries for {len(reqs)} requests; "
                "want a list with one entry per request")
            for req, d in zip(reqs, drafts):
                if isinstance(d, DraftTree):
                    assert "tree" in shapes, f"{req.rid}: a DraftTree from a spec with draft_shapes={shapes!r}"
                    assert len(d.parents) == len(d.tokens), (
                        f"{req.rid}: a DraftTree of {len(d.tokens)} tokens and {len(d.parents)} parents")
                    assert all(-1 <= p < i for i, p in enumerate(d.parents)), (
                        f"{req.rid}: DraftTree parents {d.parents}: each must be -1 or an earlier node")
                    d = d.tokens
                assert len(d) <= req.max_draft, f"{req.rid}: {len(d)} drafts {d} above max_draft={req.max_draft}"
                bad = [t for t in d if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
                assert not bad, f"{req.rid}: draft ids {bad} are not ints inside the vocabulary (0..{self.vocab_size - 1})"
            proposer.on_verified(reqs, [0] * len(reqs))
            # The target appended one token of its own to every request.
            for out in outputs:
                out.append(rng.randrange(self.vocab_size))
        for rid, prompt, out in zip(rids, prompts, outputs):
            proposer.on_request_end(RequestEnd(rid, prompt, list(out), "finished", {"type": "length", "length": len(out)}))
            call_with_accepted(proposer.release, rid, reason="finished")
        call_with_accepted(proposer.release, f"kit-{self.seed}-never-proposed", reason="aborted")

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
