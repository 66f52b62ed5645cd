"""``check_greedy_until_near_tie`` (engine.testing.conformance.model): where half-precision greedy
outputs part, the two chosen tokens must be a near-tie, judged by transformers' own half-precision
logits or, when given, by a float32 oracle model's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.testing.conformance import check_greedy_until_near_tie

VOCAB = 8
PROMPT = [1, 2]


class _FixedLogits:
    """Stands for a transformers model as ``hf_last_logits`` uses it (``device``, ``dtype``, a call
    returning ``.logits`` of shape [batch, seq, vocab]): the last position's logits are ``last``
    whatever the input, and each call records the ids it was given."""

    def __init__(self, last: list[float], dtype: torch.dtype) -> None:
        assert len(last) == VOCAB
        self.last = torch.tensor(last, dtype=dtype)
        self.dtype = dtype
        self.device = torch.device("cpu")
        self.calls: list[list[int]] = []

    def __call__(self, input_ids: torch.Tensor) -> Any:
        self.calls.append(input_ids[0].tolist())
        logits = torch.zeros(1, input_ids.shape[1], VOCAB, dtype=self.dtype)
        logits[0, -1] = self.last
        return SimpleNamespace(logits=logits)


def _logits(**by_token: float) -> list[float]:
    values = [0.0] * VOCAB
    for name, value in by_token.items():
        values[int(name.removeprefix("t"))] = value
    return values


# Our run chose token 4 at position 2 where transformers' bf16 run chose 3. transformers' own bf16
# logits put 3 a clear 0.5 above 4; in float32 the two are 0.1 apart (3 above 4), and 5 leads both.
BF16 = _logits(t3=20.5, t4=20.0, t5=19.0)
FP32 = _logits(t3=20.3, t4=20.2, t5=20.4)
REF = [6, 7, 3, 6]
OURS = [6, 7, 4, 5]


def test_float32_oracle_accepts_a_departure_within_tolerance_that_bf16_logits_reject() -> None:
    hf_model, oracle = _FixedLogits(BF16, torch.bfloat16), _FixedLogits(FP32, torch.float32)
    with pytest.raises(AssertionError, match=r"token 2 differs \(4 vs transformers' 3\) with a logit gap of 0.500 > "
                                             r"0.25 \(judged by the bf16 oracle"):
        check_greedy_until_near_tie(hf_model, PROMPT, OURS, REF, 4, 0.25, "chat 0")
    check_greedy_until_near_tie(hf_model, PROMPT, OURS, REF, 4, 0.25, "chat 0", oracle_model=oracle)
    # the oracle was asked about the context both runs shared up to the departure
    assert oracle.calls == [PROMPT + REF[:2]]


def test_float32_oracle_accepts_either_token_leading_within_tolerance() -> None:
    hf_model = _FixedLogits(BF16, torch.bfloat16)
    oracle = _FixedLogits(_logits(t3=20.0, t4=20.2), torch.float32)  # ours leads by 0.2
    check_greedy_until_near_tie(hf_model, PROMPT, OURS, REF, 4, 0.25, "chat 0", oracle_model=oracle)
    assert hf_model.calls == []  # the bf16 logits judged nothing


@pytest.mark.parametrize(("ref_logit", "ours_logit", "gap"), [(20.6, 20.2, "+0.400"), (20.0, 20.4, "-0.400")])
def test_float32_oracle_rejects_a_departure_beyond_tolerance_either_way(ref_logit: float, ours_logit: float,
                                                                        gap: str) -> None:
    hf_model = _FixedLogits(_logits(t3=20.0, t4=20.0), torch.bfloat16)  # a tie in bf16
    oracle = _FixedLogits(_logits(t3=ref_logit, t4=ours_logit, t5=21.0), torch.float32)
    with pytest.raises(AssertionError) as info:
        check_greedy_until_near_tie(hf_model, PROMPT, OURS, REF, 4, 0.25, "chat 3", oracle_model=oracle)
    message = str(info.value)
    assert "chat 3: token 2 differs (4 vs transformers' 3)" in message
    assert f"float32 logit gap of {gap}" in message and "judged by the float32 oracle" in message
    assert f"argmax 5 21.000, transformers' 3 {ref_logit:.3f}, ours 4 {ours_logit:.3f}" in message


def test_without_an_oracle_the_bf16_rule_is_unchanged() -> None:
    # gap = logit(ref) - logit(ours) from transformers' own logits; ours leading by any amount passes
    check_greedy_until_near_tie(_FixedLogits(_logits(t3=20.0, t4=20.25), torch.bfloat16),
                                PROMPT, OURS, REF, 4, 0.25, "p")
    check_greedy_until_near_tie(_FixedLogits(_logits(t3=20.0, t4=25.0), torch.bfloat16),
                                PROMPT, OURS, REF, 4, 0.25, "p")
    check_greedy_until_near_tie(_FixedLogits(_logits(t3=20.25, t4=20.0), torch.bfloat16),
                                PROMPT, OURS, REF, 4, 0.25, "p")
    with pytest.raises(AssertionError, match=r"logit gap of 0.375 > 0.25 \(judged by the bf16 oracle.*"
                                             r"no float32 oracle given\): not a rounding tie"):
        check_greedy_until_near_tie(_FixedLogits(_logits(t3=20.375, t4=20.0), torch.bfloat16),
                                    PROMPT, OURS, REF, 4, 0.25, "p")
    with pytest.raises(AssertionError, match=r"judged by the fp16 oracle"):
        check_greedy_until_near_tie(_FixedLogits(_logits(t3=21.0, t4=20.0), torch.float16),
                                    PROMPT, OURS, REF, 4, 0.25, "p")


def test_equal_outputs_pass_without_asking_either_model() -> None:
    hf_model, oracle = _FixedLogits(BF16, torch.bfloat16), _FixedLogits(FP32, torch.float32)
    check_greedy_until_near_tie(hf_model, PROMPT, REF, list(REF), 4, 0.25, "p", oracle_model=oracle)
    assert hf_model.calls == oracle.calls == []
    with pytest.raises(AssertionError, match="p: lengths differ"):
        check_greedy_until_near_tie(hf_model, PROMPT, REF[:2], REF[:3], 4, 0.25, "p", oracle_model=oracle)


def test_an_oracle_not_in_float32_is_refused() -> None:
    with pytest.raises(ValueError, match=r"oracle_model computes in torch.bfloat16; accepted: a float32"):
        check_greedy_until_near_tie(_FixedLogits(BF16, torch.bfloat16), PROMPT, OURS, REF, 4, 0.25, "p",
                                    oracle_model=_FixedLogits(FP32, torch.bfloat16))
