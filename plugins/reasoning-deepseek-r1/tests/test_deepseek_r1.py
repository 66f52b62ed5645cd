"""The deepseek-r1 reasoning parser on recorded DeepSeek-R1-distill outputs (the conformance kit)."""

from __future__ import annotations

from engine.testing import ReasoningCase, ReasoningParserConformance


class TestDeepSeekR1(ReasoningParserConformance):
    parser_name = "deepseek-r1"
    cases = (
        ReasoningCase("Okay, so I need to find 2 + 3. That's 5.\n</think>\n\nThe answer is **5**.",
                      "Okay, so I need to find 2 + 3. That's 5.", "The answer is **5**.",
                      label="template opened <think>"),
        ReasoningCase("<think>\nHmm, a <b>tag</b> inside.\n</think>\nDone.", "Hmm, a <b>tag</b> inside.", "Done.",
                      label="model wrote <think> anyway"),
        ReasoningCase("I am still thinking about </thi", "I am still thinking about </thi", "",
                      label="cut off: all reasoning"),
    )
