"""The ``deepseek-r1`` reasoning parser: the chat template opens ``<think>``, so the output
starts inside the reasoning (DeepSeek-R1 and its distills, Qwen3 thinking-2507). Registration only."""

from __future__ import annotations

from engine.hookspecs import ReasoningParserSpec, hookimpl


@hookimpl
def register_reasoning_parsers(register):  # type: ignore[no-untyped-def]
    register(ReasoningParserSpec(
        name="deepseek-r1", factory="engine_reasoning_deepseek_r1.parser:DeepSeekR1ReasoningParser",
        description="output starts inside <think> (opened by the template) and reasons until </think>"))
