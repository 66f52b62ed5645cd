"""Qwen3-style reasoning: the model writes ``<think>...</think>`` before its answer when it
thinks; with thinking off (``chat_template_kwargs: {"enable_thinking": false}``, which puts an
empty think block in the prompt) it answers directly, and the output is all content."""

from __future__ import annotations

from engine.parsers import ThinkTagReasoningParser


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    starts_in_reasoning = False
