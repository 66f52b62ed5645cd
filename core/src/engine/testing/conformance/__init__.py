"""Base test classes of the conformance kit, one module per plugin kind (see ``engine.testing``).

Before the kit was split by kind it was this one module, and it drew the attention kit's batches
from the ``random`` and ``torch`` modules it had imported, so plugin conftests seeded the kit
through ``engine.testing.conformance.random`` and ``.torch``. Those two names still resolve, with
a ``DeprecationWarning`` naming the replacement (the kit class's ``seed``; docs/stability.md).
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.deprecation import warn_deprecated
from engine.testing.conformance.attention import AttentionBackendConformance
from engine.testing.conformance.kv_tier import KvStorageTierConformance, check_kv_tier
from engine.testing.conformance.kv_transfer import KvTransferConformance
from engine.testing.conformance.lora import LoraBackendConformance, check_lora_backend
from engine.testing.conformance.model import ModelConformance, check_greedy_until_near_tie
from engine.testing.conformance.parsers import (
    ReasoningCase,
    ReasoningParserConformance,
    ToolCallCase,
    ToolCallParserConformance,
)
from engine.testing.conformance.platform import PlatformConformance
from engine.testing.conformance.policy import SchedulePolicyConformance
from engine.testing.conformance.quant import QuantMethodConformance
from engine.testing.conformance.router import RouterPolicyConformance
from engine.testing.conformance.speculative import SpeculativeProposerConformance

__all__ = [
    "AttentionBackendConformance",
    "KvStorageTierConformance",
    "KvTransferConformance",
    "LoraBackendConformance",
    "ModelConformance",
    "PlatformConformance",
    "QuantMethodConformance",
    "RouterPolicyConformance",
    "ReasoningCase",
    "ReasoningParserConformance",
    "SchedulePolicyConformance",
    "SpeculativeProposerConformance",
    "ToolCallCase",
    "ToolCallParserConformance",
    "check_greedy_until_near_tie",
    "check_kv_tier",
    "check_lora_backend",
]


# The old single module's names that plugin conftests used to seed the kit, and the module each
# stood for.
_DEPRECATED_MODULE_NAMES = ("random", "torch")


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED_MODULE_NAMES:
        warn_deprecated(f"engine.testing.conformance.{name}")
        return importlib.import_module(name)
    raise AttributeError(f"module 'engine.testing.conformance' has no attribute '{name}'")
