"""Expert parallelism on the CPU (gloo, one process per rank): ``--tp-size 2 --ep-size 2`` equals
one rank and transformers token for token.

Qwen2-MoE exercises the most at once: routed experts split across the ranks (2 of 4 each), the
shared expert split by tensor parallelism, and a dense layer (``mlp_only_layers``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine import Engine
from engine.errors import ConfigError, EngineError
from engine.testing.checkpoints import hf_greedy, load_hf_model, make_tiny_checkpoint

MAX_NEW = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("ep-qwen2moe")), "Qwen2MoeForCausalLM", seed=3,
                                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, mlp_only_layers=[1], num_hidden_layers=3)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(4, 2048) for _ in range(n)] for n in (1, 11, 6)]


def _generate(ckpt: str, prompts: list[list[int]], **kw: Any) -> list[list[int]]:
    with Engine(model_path=ckpt, max_total_tokens=512, log_level="warning", **kw) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})
    return [o["output_ids"] for o in outs]


def test_ep2_equals_ep1_and_transformers(ckpt: str, prompts: list[list[int]]) -> None:
    model = load_hf_model(ckpt)
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    single = _generate(ckpt, prompts)
    assert single == expected
    assert _generate(ckpt, prompts, tp_size=2, ep_size=2) == single


def test_ep_size_must_divide_tp_size(ckpt: str) -> None:
    with pytest.raises(ConfigError, match=r"--ep-size: invalid value 2; accepted: a divisor of --tp-size \(1\)"):
        Engine(model_path=ckpt, ep_size=2, max_total_tokens=512, log_level="warning")


def test_ep_size_must_divide_the_experts(tmp_path: Any) -> None:
    path = make_tiny_checkpoint(str(tmp_path), "Qwen3MoeForCausalLM", num_experts=3, num_experts_per_tok=2,
                                moe_intermediate_size=32)
    with pytest.raises(EngineError, match=r"--ep-size: invalid value 2 for this model \(3 experts\).*accepted: 1"):
        Engine(model_path=path, tp_size=2, ep_size=2, max_total_tokens=512, log_level="warning")
