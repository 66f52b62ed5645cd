"""Base test classes of the conformance kit, one module per plugin kind (see ``engine.testing``)."""

from engine.testing.conformance.attention import AttentionBackendConformance
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
]
