"""The test harness's near-tie comparison (used by the half-precision speculative GPU tests)."""

from __future__ import annotations

import pytest

from engine.testing.harness import assert_equal_up_to_near_ties, last_position_logits, make_scheduler


@pytest.fixture(scope="module")
def sched(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("harness")), "LlamaForCausalLM")
    return make_scheduler(path)


def test_equal_outputs_pass(sched) -> None:  # type: ignore[no-untyped-def]
    assert_equal_up_to_near_ties(sched, [[1, 2, 3]], [[4, 5]], [[4, 5]])


def test_a_difference_between_near_tied_tokens_passes_and_a_clear_one_fails(sched) -> None:  # type: ignore[no-untyped-def]
    prompt = [7, 8, 9, 10]
    logits = last_position_logits(sched, [prompt])[0]
    order = logits.argsort(descending=True).tolist()
    top, runner_up, worst = order[0], order[1], order[-1]
    gap = float(logits[top] - logits[runner_up])
    assert_equal_up_to_near_ties(sched, [prompt], [[top]], [[runner_up]], max_gap=gap + 1e-4)
    with pytest.raises(AssertionError, match="first difference at token 0 .* is not a near-tie"):
        assert_equal_up_to_near_ties(sched, [prompt], [[top]], [[worst]], max_gap=gap + 1e-4)


def test_an_output_cut_short_fails(sched) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(AssertionError, match="one output is a prefix of the other"):
        assert_equal_up_to_near_ties(sched, [[1, 2]], [[4, 5, 6]], [[4, 5]])
