"""Speculative decoding: proposers (a plugin kind), chain and tree verification and its KV bookkeeping.

See docs/speculative.md. ``Proposer``/``ProposerContext``/``DraftRequest`` are the plugin
interface; ``engine.speculative.worker.Speculator`` runs a speculative decode step for the
scheduler; ``engine.speculative.verify`` decides which drafts are kept.
"""

from engine.speculative.base import (
    DraftRequest,
    DraftTree,
    Proposer,
    ProposerContext,
    ReleaseReason,
    RequestEnd,
    TargetHidden,
)

__all__ = ["DraftRequest", "DraftTree", "Proposer", "ProposerContext", "ReleaseReason", "RequestEnd", "TargetHidden"]
