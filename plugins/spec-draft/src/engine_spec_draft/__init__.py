"""The ``draft`` speculative proposer: a smaller model of the same tokenizer drafts greedily.

Registration only; ``engine_spec_draft.proposer`` builds the draft model when selected.
"""

from __future__ import annotations

from engine.hookspecs import PluginOption, SpeculativeAlgorithmSpec, hookimpl


@hookimpl
def register_speculative_algorithms(register):  # type: ignore[no-untyped-def]
    register(SpeculativeAlgorithmSpec(
        name="draft", factory="engine_spec_draft.proposer:create", needs_draft_model=True,
        description="A smaller model (--speculative-draft-model-path) drafts k tokens greedily in its own KV pool"))


@hookimpl
def register_plugin_options(register):  # type: ignore[no-untyped-def]
    # On by default: plugins/spec-draft/tests/test_draft_graphs_gpu.py checks the captured draft
    # steps give the eager steps' tokens; off: the draft's decode steps run eagerly.
    register(PluginOption("draft", "cuda_graph", True,
                          "capture CUDA graphs for the draft model's decode steps (as the target does)"))
