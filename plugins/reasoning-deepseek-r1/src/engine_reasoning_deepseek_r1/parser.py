"""DeepSeek-R1-style reasoning: the chat template ends the prompt with ``<think>\\n``, so the
model's output is reasoning up to ``</think>`` and the answer after it. A ``<think>`` the model
writes anyway is dropped; an output with no ``</think>`` (cut off) is all reasoning."""

from __future__ import annotations

from engine.parsers import ThinkTagReasoningParser


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    starts_in_reasoning = True
