"""ngram speculation under tensor parallelism on the CPU (gloo, one process per rank): rank 0's
drafts and acceptance decide, and the output equals TP=1 without speculation (a scheduler in the
test's own process)."""

from __future__ import annotations

import pytest

from engine import Engine
from engine.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tp-spec")), "LlamaForCausalLM",
                                num_key_value_heads=2, num_hidden_layers=2)


PHRASE = [11, 400, 52, 930, 7, 1500]
PROMPTS = [PHRASE * 4, [5, 6, 7, 8], PHRASE[:3] * 5]


def test_ngram_under_tp2_equals_tp1_plain(ckpt: str) -> None:
    from engine.testing.harness import generate_greedy, make_scheduler

    with Engine(model_path=ckpt, max_total_tokens=512, log_level="warning", tp_size=2,
                speculative_algorithm="ngram") as eng:
        spec = eng.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 16, "temperature": 0})
    assert [o["output_ids"] for o in spec] == generate_greedy(make_scheduler(ckpt, max_total_tokens=512), PROMPTS, 16)
    assert spec[0]["meta_info"]["spec_accepted_tokens"] > 0  # the repeated phrase was drafted and kept
