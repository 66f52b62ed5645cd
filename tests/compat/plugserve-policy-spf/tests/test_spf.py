"""The conformance kit against the `spf` policy."""

from __future__ import annotations

from engine.testing import SchedulePolicyConformance


class TestShortestPromptFirst(SchedulePolicyConformance):
    policy_name = "spf"
