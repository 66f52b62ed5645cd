"""The ``eagle`` speculative proposer: an EAGLE-1/2 or EAGLE-3 head drafts on the target's
hidden states.

Registration only; ``engine_spec_eagle.proposer`` loads the head when selected.
"""

from __future__ import annotations

from engine.hookspecs import SpeculativeAlgorithmSpec, hookimpl


@hookimpl
def register_speculative_algorithms(register):  # type: ignore[no-untyped-def]
    register(SpeculativeAlgorithmSpec(
        name="eagle", factory="engine_spec_eagle.proposer:create", needs_draft_model=True,
        needs_hidden_states=True, draft_shapes=("chain", "tree"),
        description="An EAGLE-1/2 or EAGLE-3 head (--speculative-draft-model-path) drafts a chain, or with "
                    "--speculative-eagle-topk > 1 an EAGLE-2 tree, on the target's hidden states"))
