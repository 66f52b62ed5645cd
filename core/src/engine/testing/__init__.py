"""The conformance kit: base test classes plugin authors subclass in their own tests.

- ``AttentionBackendConformance``: the backend matches a float64 reference on random paged batches.
- ``ModelConformance``: the model plugin matches Hugging Face transformers (logits and greedy tokens).
- ``SchedulePolicyConformance``: the policy orders a queue deterministically, as a permutation.
- ``PlatformConformance``: the platform answers its probes.
- ``QuantMethodConformance``: a linear layer through the method round-trips within a stated error.
- ``RouterPolicyConformance``: a data-parallel router policy picks valid replicas, deterministically.
- ``ToolCallParserConformance`` / ``ReasoningParserConformance``: a parser reads its recorded
  outputs right, whole and streamed with every chunk boundary (``ToolCallCase``, ``ReasoningCase``).
- ``SpeculativeProposerConformance``: a speculative proposer returns well-formed drafts and the
  engine with it gives exactly the output without speculation (greedy, tiny model).
- ``LoraBackendConformance`` (``check_lora_backend``): a LoRA backend's segmented shrink/expand
  match the torch reference, empty segments and rank-0 slots included.
- ``KvStorageTierConformance`` (``check_kv_tier``): a KV storage tier returns what was written,
  bit-exactly, keeps ranks apart and backs the hierarchical prefix cache.
- ``KvTransferConformance``: a KV transfer backend (prefill/decode disaggregation) moves payloads
  bit-exactly, refuses a layout mismatch naming it and ends every fetch by its deadline.
- ``GrammarBackendConformance`` (``engine.testing.grammar_kit``): a grammar backend accepts exactly
  its grammars' strings and its masks agree with a reference.

Each class is a plain pytest class (no ``Test`` prefix, so it is not collected by
itself); subclass it as ``TestMyBackend(AttentionBackendConformance)`` and set the
class attributes it documents. Checkpoint helpers live in ``engine.testing.checkpoints``.
"""

from engine.testing.conformance import (
    AttentionBackendConformance,
    KvStorageTierConformance,
    KvTransferConformance,
    LoraBackendConformance,
    ModelConformance,
    PlatformConformance,
    QuantMethodConformance,
    ReasoningCase,
    ReasoningParserConformance,
    RouterPolicyConformance,
    SchedulePolicyConformance,
    SpeculativeProposerConformance,
    ToolCallCase,
    ToolCallParserConformance,
)
from engine.testing.grammar_kit import GrammarBackendConformance

__all__ = [
    "AttentionBackendConformance",
    "KvStorageTierConformance",
    "KvTransferConformance",
    "GrammarBackendConformance",
    "LoraBackendConformance",
    "ModelConformance",
    "PlatformConformance",
    "QuantMethodConformance",
    "ReasoningCase",
    "ReasoningParserConformance",
    "RouterPolicyConformance",
    "SchedulePolicyConformance",
    "SpeculativeProposerConformance",
    "ToolCallCase",
    "ToolCallParserConformance",
]
