"""The ``qwen3`` reasoning parser: the model opens ``<think>`` itself (Qwen3, QwQ). Registration only."""

from __future__ import annotations

from engine.hookspecs import ReasoningParserSpec, hookimpl


@hookimpl
def register_reasoning_parsers(register):  # type: ignore[no-untyped-def]
    register(ReasoningParserSpec(
        name="qwen3", factory="engine_reasoning_qwen3.parser:Qwen3ReasoningParser",
        description="<think>...</think> written by the model; an output without <think> is all content"))
